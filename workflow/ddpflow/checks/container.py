"""machine.container, checked before anything is submitted: a runtime the launcher can use,
an image that is there, binds the runtime understands (ddpflow.cluster.container runs them).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ddpflow.cluster.container import image_path, of
from ddpflow.config.schema import ConfigError

# the command each runtime is started with (pyxis is srun's)
COMMANDS = {"apptainer": "apptainer", "charliecloud": "ch-run", "podman-hpc": "podman-hpc"}


def check_container(where: str, machine: dict, launcher: str) -> None:
    """Refuse, naming the key and the fix, a machine.container that cannot start a job."""
    container = of(machine)
    if container is None:
        return
    runtime = container["runtime"]
    key = f"{where}: machine.container"
    if runtime == "pyxis" and launcher != "slurm":
        raise ConfigError(
            f"{key}.runtime pyxis starts the image through srun (a Slurm plug-in): run with "
            "--profile slurm, or use apptainer, charliecloud or podman-hpc here"
        )
    for entry in container["binds"]:
        _check_bind(key, runtime, entry)
    if launcher == "local" and _missing_image(container):
        raise ConfigError(f"{key}.image {container['image']}: {_missing_image(container)}")
    command = COMMANDS.get(runtime)
    if launcher == "local" and command and shutil.which(command) is None:
        raise ConfigError(
            f"{key}.runtime {runtime}: its command {command} is not on this machine's PATH "
            "(the local launcher starts the ranks here): install it or load its module"
        )


def container_warnings(where: str, machine: dict, launcher: str) -> list[str]:
    """An image file missing on the login node under Slurm: a site may keep images where only
    the compute nodes see them (pyxis reads its SquashFS file on the node), so said, not
    refused (the local launcher refuses it: check_container)."""
    container = of(machine)
    if container is None or launcher != "slurm" or not (missing := _missing_image(container)):
        return []
    return [
        f"{where}: machine.container.image {container['image']}: {missing} here; the jobs "
        "fail unless every compute node has it"
    ]


def _missing_image(container: dict) -> str:
    """Why the image is not there ("" where it is, or is a name or URI the runtime pulls)."""
    image = image_path(container)
    if not image.startswith("/") or Path(image).exists():
        return ""
    built = (
        " (`make image` writes images/ddpflow)" if container["runtime"] == "charliecloud" else ""
    )
    return f"no such file or directory{built}"


def _check_bind(key: str, runtime: str, entry: str) -> None:
    parts = entry.split(":")
    src, dst = parts[0], parts[1] if len(parts) > 1 else parts[0]
    options = parts[2] if len(parts) > 2 else ""
    problem = ""
    if len(parts) > 3 or not src:
        problem = "is not SRC, SRC:DST or SRC:DST:OPTIONS"
    elif not dst.startswith(("/", "$")):
        problem = f"binds at {dst}, which is not an absolute path inside the image"
    elif options and runtime == "charliecloud":
        problem = f"has options ({options}), which ch-run's --bind does not take"
    elif options and not set(options.split(",")) <= {"ro", "rw"}:
        problem = f"has options {options}; ro or rw are understood by every runtime"
    if problem:
        raise ConfigError(f"{key}.binds entry {entry!r} {problem}")
