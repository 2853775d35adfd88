"""Folders only their owner can reach: a job's folder (submitit's pickles, which a node loads
and runs, and the ranks' logs) and a run's work folder (checkpoints, the rendezvous port
files). Whoever can write such a folder can make the next job run their code as you (a
pickle is code) or point the ranks at their own store; so they are created 0700, the files
ddpflow writes in them are 0600 (runtime.atomic_writer: a file in a private folder is
private), and one that others can write, or that someone else owns, is refused before
anything is loaded from it, naming the `chmod` that fixes it.

The folders above them, up to ddpflow's own (results/work, logs/submitit), are checked too:
whoever can write a parent can move your folder aside and put another in its place between
the check and the load. A parent that is only yours (or root's) to write, or that has the
sticky bit (as /tmp: nobody can rename what another owns there), is safe; one others can
write is refused naming its `chmod go-w`. ddpflow creates the parents it needs 0755,
whatever the umask.

The check runs on the login node before a job is submitted, in the job's batch script
before the node loads submitit's pickle (`refusal_script`), and on every rank before a
checkpoint is read.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import stat
from pathlib import Path

from ddpflow.errors import UserError

PRIVATE = 0o700


class OpenFolder(UserError):
    """A job or work folder that others can write (or that another user owns)."""


def problem(path: str | Path) -> str | None:
    """Why `path` is not private to this user, or None (also None when it does not exist)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    if info.st_uid != os.getuid():
        return f"it belongs to uid {info.st_uid}, not to you (uid {os.getuid()})"
    writable = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable:
        who = " and ".join(
            name
            for bit, name in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "every user"))
            if writable & bit
        )
        return f"{who} can write it (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def parent_problem(path: str | Path) -> str | None:
    """Why others could rename what is in `path`, or None (also None when it does not exist):
    owned by someone other than you or root, or writable by others without the sticky bit."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    if info.st_uid not in (os.getuid(), 0):
        return f"it belongs to uid {info.st_uid}, not to you (uid {os.getuid()}) or root"
    if info.st_mode & stat.S_ISVTX:
        return None
    return problem(path) if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) else None


def parents(path: str | Path, top: str | Path) -> list[Path]:
    """The folders from `path`'s parent up to `top` (inclusive), nearest first; just the
    parent where `top` is not above `path`."""
    path, top = Path(path), Path(top)
    chain = []
    for parent in path.parents:
        chain.append(parent)
        if parent == top:
            return chain
    return chain[:1]


def check_parents(path: str | Path, what: str, top: str | Path) -> None:
    """Refuse a parent of `path` (up to `top`) that others can write: they could swap
    `path` for a folder of their own between the check and the load."""
    for parent in parents(path, top):
        why = parent_problem(parent)
        if why is not None:
            raise OpenFolder(
                f"{what} {path}: its parent {parent}: {why}. Whoever can write it can move "
                f"{Path(path).name} aside and put their own folder in its place; fix: "
                f"chmod go-w {shlex.quote(str(parent))}, then rerun"
            )


def check(path: str | Path, what: str) -> None:
    """Refuse a folder others can write, before anything is loaded from it."""
    why = problem(path)
    if why is not None:
        raise OpenFolder(
            f"{what} {path}: {why}. Whoever can write it can run code as you through what "
            f"the job loads from it; fix: chmod 700 {shlex.quote(str(path))} (and remove "
            "anything in it you did not write), then rerun"
        )


def make(path: str | Path, what: str, top: str | Path | None = None) -> Path:
    """The folder, created 0700 or, where it exists, checked and made 0700 (ddpflow's own
    folders: a 0755 one from an older version is tightened). Its parents up to `top`
    (default: its parent) must be safe (check_parents); missing ones are created 0755."""
    path = Path(path)
    top = Path(top) if top is not None else path.parent
    check_parents(path, what, top)
    check(path, what)
    top.parent.mkdir(parents=True, exist_ok=True)
    for parent in reversed(parents(path, top)):
        with contextlib.suppress(FileExistsError):
            parent.mkdir(mode=0o755)  # the umask only removes bits: never group-writable
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=PRIVATE)
    os.chmod(path, PRIVATE)  # mkdir's mode is masked by the umask; an old folder is tightened
    return path


def seal_files(folder: str | Path, pattern: str = "*.pkl") -> None:
    """Files another program wrote in a private folder (submitit's pickles): 0600."""
    for file in Path(folder).glob(pattern):
        try:
            os.chmod(file, 0o600)
        except OSError:
            continue


def refusal_script(
    folder: str | Path, what: str = "the job folder", top: str | Path | None = None
) -> str:
    """A shell line for the job's batch script: stop before submitit loads its pickle from
    `folder` if others can write it (or it is not the job owner's), or can write one of its
    parents up to `top` (default: its parent) without the sticky bit."""
    quoted = shlex.quote(str(folder))
    chain = parents(folder, top if top is not None else Path(folder).parent)
    above = " ".join(shlex.quote(str(parent)) for parent in chain)
    message = shlex.quote(
        f"ddpflow: {what} {folder} can be written by others or is not yours, or so can one of "
        f"its parents ({', '.join(map(str, chain))}): refusing to load its pickles; fix: chmod "
        f"700 {folder} and chmod go-w on the parent"
    )
    open_parent = f"find {above} -maxdepth 0 -perm /022 ! -perm -1000 2>/dev/null"
    return (
        f'if [ ! -O {quoted} ] || [ -n "$(find {quoted} -maxdepth 0 -perm /022)" ] '
        f'|| [ -n "$({open_parent})" ]; then echo {message} >&2; exit 1; fi'
    )


def job_root(folder: str | Path) -> Path:
    """ddpflow's own folder above a job folder (logs/submitit/<run>/<stage>): logs/submitit,
    the topmost parent checked."""
    return Path(folder).parents[1]


def make_job_folder(folder: str | Path) -> Path:
    """A job folder (its pickles are code the node runs), its parents checked up to
    logs/submitit."""
    return make(folder, "job folder", top=job_root(folder))


def job_refusal_script(folder: str | Path) -> str:
    """refusal_script for a job folder, its parents checked up to logs/submitit."""
    return refusal_script(folder, top=job_root(folder))
