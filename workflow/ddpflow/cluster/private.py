"""Folders only their owner can reach: a job's folder (submitit's pickles, which a node loads
and runs, and the ranks' logs) and a run's work folder (checkpoints, the rendezvous port
files). Whoever can write such a folder can make the next job run their code as you (a
pickle is code) or point the ranks at their own store; so they are created 0700, the files
ddpflow writes in them are 0600 (runtime.atomic_writer: a file in a private folder is
private), and one that others can write, or that someone else owns, is refused before
anything is loaded from it, naming the `chmod` that fixes it.

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


def check(path: str | Path, what: str) -> None:
    """Refuse a folder others can write, before anything is loaded from it."""
    why = problem(path)
    if why is not None:
        raise OpenFolder(
            f"{what} {path}: {why}. Whoever can write it can run code as you through what "
            f"the job loads from it; fix: chmod 700 {shlex.quote(str(path))} (and remove "
            "anything in it you did not write), then rerun"
        )


def make(path: str | Path, what: str) -> Path:
    """The folder, created 0700 (parents as usual) or, where it exists, checked and made
    0700 (ddpflow's own folders: a 0755 one from an older version is tightened)."""
    path = Path(path)
    check(path, what)
    path.parent.mkdir(parents=True, exist_ok=True)
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


def refusal_script(folder: str | Path, what: str = "the job folder") -> str:
    """A shell line for the job's batch script: stop before submitit loads its pickle from
    `folder` if others can write it (or it is not the job owner's)."""
    quoted = shlex.quote(str(folder))
    message = shlex.quote(
        f"ddpflow: {what} {folder} can be written by others or is not yours: refusing to load "
        f"its pickles; fix: chmod 700 {folder}"
    )
    return (
        f'if [ ! -O {quoted} ] || [ -n "$(find {quoted} -maxdepth 0 -perm /022)" ]; '
        f"then echo {message} >&2; exit 1; fi"
    )
