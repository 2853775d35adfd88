"""machine.container: every job ddpflow submits runs its Python inside an image, in one place.

submitit starts each rank as `<python> -u -m submitit.core._submit <folder>`, under srun on
Slurm and as a process locally. The container wrapper is that `python` (apptainer,
charliecloud, podman-hpc) or srun options before it (pyxis, a Slurm SPANK plugin). The
project, the job folder, data, results and node-local copies are bound at their own paths,
so that every path a rank is given means the same file inside; Slurm's, submitit's and the
rendezvous variables reach the ranks (podman-hpc passes only what it is told to).

    apptainer     apptainer exec [--nv] --bind SRC:DST ... --pwd CWD --env K=V ... IMAGE python3
    charliecloud  ch-run -b SRC:DST ... -c CWD --set-env=K=V ... IMAGE -- python3
    podman-hpc    podman-hpc run --rm [--gpu] --net host --ipc host -v SRC:DST ... -w CWD
                  -e SLURM_* ... -e K=V ... IMAGE python3
    pyxis         srun ... --container-image=IMAGE --container-mounts=SRC:DST,...
                  --container-workdir=CWD python3

GPUs: apptainer --nv and podman-hpc --gpu where machine.gpus_per_node > 0; pyxis (enroot's
hooks) and Charliecloud (`ch-fromhost --nvidia IMAGE`, once per image) need no flag.
The staging job (machine.stage.where: job) runs its Python through argv() (stage_argv).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ddpflow.cluster.software import IMAGE_VAR, RUNTIME_VAR
from ddpflow.errors import UserError

RUNTIMES = ("apptainer", "charliecloud", "podman-hpc", "pyxis")
# ch-run passes the host's environment in, PATH included: a PATH that leads to the login
# node's virtual environment (bound at its own path with the project) would start the host's
# Python inside the image. The image's own PATH instead (machine.container.env may set one).
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# podman passes no host variable unless named (a name ending in * passes all with its prefix)
PODMAN_PASSED = (
    *("SLURM_*", "SLURMD_*", "SUBMITIT_*", "MASTER_*", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    *("DDPFLOW_*", "CUDA_VISIBLE_DEVICES", "NCCL_*", "GLOO_*", "TORCH_*", "OMP_NUM_THREADS"),
    *("USER", "HOME", "TMPDIR"),
)
# the host's own, mounted by every runtime: never bound again
SYSTEM_DIRS = ("/dev", "/proc", "/sys", "/etc", "/run")


DEFAULTS = {"binds": [], "env": {}, "python": "python3", "options": []}
# pyxis images that are files (enroot's SquashFS); anything else is a registry image
SQUASHFS_SUFFIXES = (".sqsh", ".sqfs", ".squashfs")


def of(machine: Mapping[str, Any]) -> dict[str, Any] | None:
    """The machine's container section with its defaults (None: the host's Python, today's
    behaviour)."""
    container = machine.get("container")
    return None if container is None else {**DEFAULTS, **container}


def described(machine: Mapping[str, Any]) -> str:
    """What the terminal's submission line adds: ' in <runtime> image <image>', or ''."""
    spec = of(machine)
    return f" in {spec['runtime']} image {spec['image']}" if spec else ""


def image_path(container: Mapping[str, Any]) -> str:
    """The image as the runtime is given it: a path made absolute (jobs start elsewhere); a
    podman-hpc image name, an apptainer URI (docker://...) or a pyxis registry image (an
    enroot URI such as nvcr.io#nvidia/pytorch:24.05-py3) as it is."""
    image, runtime = container["image"], container["runtime"]
    named = {
        "podman-hpc": True,
        "apptainer": "://" in image,
        "pyxis": not (image.startswith(("/", ".")) or image.endswith(SQUASHFS_SUFFIXES)),
    }.get(runtime, False)
    return image if named else str(Path(image).absolute())


def job_binds(run: Mapping[str, Any], paths: Iterable[str], folder: str | Path) -> list[str]:
    """What a job reads and writes, bound at its own path: this directory (the Snakefile,
    config, results/ and logs/ by default), the directory ddpflow is imported from, the
    job's folder, the run's files, its data's sources and weights, the node-local copy,
    then machine.container.binds. Paths inside another bound one are left out."""
    import ddpflow

    data, model = run.get("data", {}), run.get("model", {})
    wanted = [os.getcwd(), str(Path(ddpflow.__file__).resolve().parents[1]), str(folder)]
    wanted += [str(Path(p).parent) for p in paths]
    for key in ("root", "path", "labels_csv"):
        wanted += [data[key]] if data.get(key) else []
    wanted += [data.get("loading", {}).get("node_local_dir") or ""]
    weights = model.get("weights") or ""
    if weights and Path(weights).exists():
        wanted.append(str(Path(weights).parent))
    elif weights and not weights.startswith("run:"):  # a torchvision name: the hub cache
        wanted.append(_torch_hub_dir())
    found = [str(Path(p).absolute()) for p in wanted if p and "$" not in p and Path(p).exists()]
    found += [p for p in wanted if "$" in p]  # expanded on the node
    chosen = _outermost(found)
    container = of(run["machine"]) or DEFAULTS
    return [*chosen, *[b for b in container["binds"] if b not in chosen]]


def _torch_hub_dir() -> str:
    """torch.hub.get_dir() without importing torch."""
    home = os.environ.get("TORCH_HOME")
    if not home:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = str(Path(cache) / "torch")
    return str(Path(home) / "hub")


def _outermost(found: list[str]) -> list[str]:
    chosen: list[str] = []
    for path in sorted(set(found), key=lambda p: (p.count("/"), p)):
        inside = any(path == c or path.startswith(c.rstrip("/") + "/") for c in chosen)
        system = any(path == s or path.startswith(s + "/") for s in SYSTEM_DIRS)
        if not (inside or system or path == "/"):
            chosen.append(path)
    return chosen


def bound(machine: Mapping[str, Any], binds: list[str]) -> dict:
    """The machine section with its container's binds as the job uses them (job_binds)."""
    if of(machine) is None:
        return dict(machine)
    return {**machine, "container": {**machine["container"], "binds": list(binds)}}


def _pair(entry: str) -> tuple[str, str, str]:
    """SRC[:DST[:OPTIONS]] as (SRC, DST, OPTIONS); DST defaults to SRC."""
    src, dst, options = (entry.split(":", 2) + ["", ""])[:3]
    return src, dst or src, options


def _shared_tmp(path: str) -> bool:
    """ch-run binds the host's $TMPDIR (or /tmp) at /tmp itself: a path under it is there
    already, and a bind below it would fail."""
    tmp = os.environ.get("TMPDIR") or "/tmp"
    return tmp == "/tmp" and (path == "/tmp" or path.startswith("/tmp/"))


def _environment(machine: Mapping[str, Any]) -> dict[str, str]:
    container = of(machine)
    assert container is not None
    env = {RUNTIME_VAR: container["runtime"], IMAGE_VAR: image_path(container)}
    if container["runtime"] == "charliecloud":
        env = {"PATH": IMAGE_PATH, **env}
    return {**env, **container["env"]}


def wrapper(machine: Mapping[str, Any], cwd: str | None = None) -> list[str]:
    """The words that run the image's Python (ending with the interpreter); pyxis: the srun
    options and the interpreter."""
    container = of(machine)
    assert container is not None
    cwd = cwd or os.getcwd()
    runtime, image, python = container["runtime"], image_path(container), container["python"]
    pairs = [_pair(b) for b in container["binds"]]
    env = _environment(machine)
    gpu = bool(machine.get("gpus_per_node"))
    options = list(container["options"])
    if runtime == "charliecloud":
        words = ["ch-run", *options]
        words += [f"--bind={s}:{d}" for s, d, _ in pairs if not _shared_tmp(d)]
        words += [f"--cd={cwd}", *[f"--set-env={k}={v}" for k, v in env.items()]]
        return [*words, image, "--", python]
    if runtime == "apptainer":
        # --nv: NVIDIA's driver inside; --rocm (AMD) in options stands instead
        nv = gpu and not {"--nv", "--rocm", "--nvccli"} & set(options)
        words = ["apptainer", "exec", *(["--nv"] if nv else []), *options]
        words += [f"--bind={':'.join(filter(None, p))}" for p in pairs]
        words += [f"--pwd={cwd}", *[f"--env={k}={v}" for k, v in env.items()]]
        return [*words, image, python]
    if runtime == "podman-hpc":
        # one container per rank: the host's network (the rendezvous) and IPC (NCCL's shared
        # memory between the ranks of a node)
        words = ["podman-hpc", "run", "--rm", *(["--gpu"] if gpu else []), "--net=host"]
        words += ["--ipc=host", *options, *[f"--volume={':'.join(filter(None, p))}" for p in pairs]]
        words += [f"--workdir={cwd}", *[f"--env={name}" for name in PODMAN_PASSED]]
        words += [f"--env={k}={v}" for k, v in env.items()]
        return [*words, image, python]
    mounts = ",".join(":".join(filter(None, p)) for p in pairs)
    return [
        f"--container-image={image}",
        *([f"--container-mounts={mounts}"] if mounts else []),
        f"--container-workdir={cwd}",
        *options,
        python,
    ]


def _shell_word(word: str) -> str:
    """A word for the batch script: quoted, but a $VARIABLE (a bind such as $TMPDIR/data)
    expands there, on the job's first node."""
    if "$" not in word:
        return shlex.quote(word)
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")
    return f'"{escaped}"'


def python_command(machine: Mapping[str, Any], launcher: str) -> str | None:
    """submitit's `python=`: the wrapper as one command line (None: the host's Python; pyxis:
    the image's interpreter, its options go to srun: srun_args)."""
    container = of(machine)
    if container is None:
        return None
    if container["runtime"] == "pyxis":
        return shlex.quote(container["python"])
    words = wrapper(machine)
    if launcher != "slurm":  # submitit's local runner splits it: no shell expands anything
        return " ".join(shlex.quote(os.path.expandvars(w)) for w in words)
    return " ".join(_shell_word(w) for w in words)


def srun_args(machine: Mapping[str, Any]) -> list[str]:
    """pyxis's options for srun (submitit's srun_args, which it quotes: a $VARIABLE in a bind
    takes its value here, on the login node); none for the other runtimes."""
    container = of(machine)
    if container is None or container["runtime"] != "pyxis":
        return []
    return [os.path.expandvars(word) for word in wrapper(machine)[:-1]]


def setup_lines(machine: Mapping[str, Any]) -> list[str]:
    """Lines the batch script (or the local runner's shell) runs before the ranks: ch-run
    refuses to start without $USER; pyxis passes the job's environment into the image."""
    container = of(machine)
    if container is None:
        return []
    if container["runtime"] == "charliecloud":
        return ['export USER="${USER:-$(id -un)}"']
    if container["runtime"] == "pyxis":
        return [f"export {k}={shlex.quote(v)}" for k, v in _environment(machine).items()]
    return []


def argv(machine: Mapping[str, Any]) -> list[str]:
    """The wrapper as a command to run here, inside a job (the staging job): pyxis through a
    job step of its own on this job's resources."""
    container = of(machine)
    assert container is not None
    words = [os.path.expandvars(w) for w in wrapper(machine)]
    if container["runtime"] == "pyxis":
        return ["srun", "--overlap", "--ntasks=1", *words]
    return words


def make_mount_points(machine: Mapping[str, Any]) -> list[str]:
    """ch-run mounts a bind only where its destination exists in the image: create the
    missing ones in a directory image (a SquashFS image cannot be changed: its binds must
    exist in it). Returns the destinations created."""
    container = of(machine)
    if container is None or container["runtime"] != "charliecloud":
        return []
    image = Path(image_path(container))
    if not image.is_dir():
        return []
    made = []
    for entry in container["binds"]:
        dst = _pair(entry)[1]
        target = image / dst.lstrip("/")
        if "$" in dst or _shared_tmp(dst) or target.is_dir():
            continue
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(
                f"machine.container.binds: {dst} does not exist in the Charliecloud image "
                f"{image} and could not be made there ({err.strerror}): create it (mkdir -p "
                f"{target}) or bind at a directory the image has (/mnt/0 to /mnt/9)"
            ) from err
        made.append(dst)
    return made
