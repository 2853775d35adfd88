"""The software a job runs with: the versions the login node plans with (passed in the
submitted job), checked on every rank before the model is built, and the runtime and image
each rank ran in (train_summary.json's "software").

A rank whose torch, CUDA or NCCL differs from the login node's fails late and obscurely (a
checkpoint that will not load, a collective that hangs); a container image with a copy of
ddpflow from an older checkout runs older code. Both are stopped at the start instead,
naming both sides. ddpflow's version carries a digest of its source files, compared where
the rank imports ddpflow from another folder than the login node (an image's own copy); the
project's package, bound at its path, is the same files (edited since or not).

    planned = planned_versions()        # login node: no torch import
    check_planned(planned, rank=3)      # each rank, first thing in the job
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import socket
from pathlib import Path
from typing import Any

from ddpflow.errors import UserError

FIELDS = ("ddpflow", "torch", "cuda", "nccl")
NAMES = {"ddpflow": "ddpflow", "torch": "torch", "cuda": "CUDA", "nccl": "NCCL"}
# set by the container wrapper (ddpflow.cluster.container) in every job it runs
RUNTIME_VAR, IMAGE_VAR = "DDPFLOW_CONTAINER_RUNTIME", "DDPFLOW_CONTAINER_IMAGE"
# per process: what the ranks gathered (DistributedTask), for train_summary.json
SEEN: dict[str, dict[str, Any]] = {}


class SoftwareMismatch(UserError):
    """A rank's software differs from the login node's plan or from another rank's."""


def ddpflow_version() -> dict[str, str]:
    """ddpflow's version with the first 12 hex digits of a sha256 over its source files, e.g.
    0.1.0+src.3f9a0c12be41, and the folder this process imports it from."""
    import ddpflow

    root = Path(ddpflow.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return {"ddpflow": f"{ddpflow.__version__}+src.{digest.hexdigest()[:12]}", "at": str(root)}


def planned_versions() -> dict[str, str | None]:
    """The login node's versions, read from the installed files without importing torch (the
    rule's process stays light). None: this node cannot tell (not compared)."""
    found = {**ddpflow_version(), "torch": "absent", "cuda": None, "nccl": None}
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return found  # no torch here: the ranks' environment decides (they agree, below)
    values = _torch_version_file(Path(next(iter(spec.submodule_search_locations))))
    found["torch"] = values.get("__version__")
    found["cuda"] = _gpu_runtime(values.get("cuda"), values.get("hip"))
    found["nccl"] = _nccl_distribution() if found["cuda"] != "none" else "none"
    return found


def _gpu_runtime(cuda: str | None, hip: str | None) -> str:
    """torch's CUDA version, "hip X" for a ROCm build (AMD GPUs), "none" for a CPU build."""
    return cuda or (f"hip {hip}" if hip else "none")


def _torch_version_file(package: Path) -> dict[str, Any]:
    """torch/version.py's assignments (what torch.__version__ and torch.version.cuda are)."""
    try:
        tree = ast.parse((package / "version.py").read_text())
    except (OSError, SyntaxError):
        return {}
    values: dict[str, Any] = {}
    for node in tree.body:
        target: ast.expr | None = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value
    return values


def _nccl_distribution() -> str | None:
    """The NCCL a pip-installed CUDA torch loads (nvidia-nccl-cu12, -cu13, ...); None where
    NCCL is not a pip package here (a site's or conda's build: not compared)."""
    for dist in importlib.metadata.distributions():
        if (dist.metadata["Name"] or "").lower().startswith("nvidia-nccl"):
            return dist.version
    return None


def rank_versions() -> dict[str, str | None]:
    """This process's versions, from the torch it imports (what the rank really runs)."""
    return dict(_rank_versions())


@functools.cache
def _rank_versions() -> dict[str, str | None]:
    import torch

    nccl = "none"
    cuda = _gpu_runtime(torch.version.cuda, getattr(torch.version, "hip", None))
    if cuda != "none" and torch.distributed.is_nccl_available():  # RCCL under ROCm
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    return {
        **ddpflow_version(),
        "torch": torch.__version__,
        "cuda": cuda,
        "nccl": nccl,
    }


def runtime_here() -> tuple[str, str | None]:
    """(runtime, image) this process runs in: the container wrapper's word, confirmed by the
    runtime's own marker where it leaves one; ("host", None) outside any."""
    declared, image = os.environ.get(RUNTIME_VAR), os.environ.get(IMAGE_VAR)
    if os.environ.get("CH_RUNNING"):  # ch-run sets it in every container
        return "charliecloud", image
    apptainer = os.environ.get("APPTAINER_CONTAINER") or os.environ.get("SINGULARITY_CONTAINER")
    if apptainer:
        return "apptainer", apptainer
    if declared == "podman-hpc" and Path("/run/.containerenv").exists():
        return "podman-hpc", image
    if declared == "pyxis":  # enroot leaves no marker of its own to confirm it by
        return "pyxis", image
    return "host", None


def changed(mine: dict, other: dict) -> list[str]:
    """The fields whose versions differ, among those both sides know (None: cannot tell)."""
    return [
        key
        for key in FIELDS
        if mine.get(key) is not None and other.get(key) is not None and mine[key] != other[key]
    ]


def check_planned(planned: dict | None, rank: int | str = "?") -> None:
    """Refuse to run where this rank's versions differ from the login node's plan (None: a
    job pickled before the plan was passed; nothing to compare)."""
    if not planned:
        return
    mine = rank_versions()
    if mine["at"] == planned.get("at"):  # the same files: the project's, bound at its path
        mine["ddpflow"] = planned["ddpflow"]
    fields = changed(mine, planned)
    if not fields:
        return
    runtime, image = runtime_here()
    inside = f"{runtime} image {image}" if image else "the host's Python (no machine.container)"
    said = {key: (mine[key], planned[key]) for key in fields}
    if "ddpflow" in said:  # where each side imports it from
        said["ddpflow"] = (
            f"{mine['ddpflow']} ({mine['at']})",
            f"{planned['ddpflow']} ({planned['at']})",
        )
    sides = "; ".join(
        f"{NAMES[key]} {here} here, {there} on the login node"
        for key, (here, there) in said.items()
    )
    raise SoftwareMismatch(
        f"rank {rank} on {socket.gethostname()} ({inside}): its software differs from what "
        f"the login node planned with: {sides}. Rebuild the image from the project's "
        "environment (make image), or point machine.container.image at one built from it "
        "(or make machine.setup load the same versions)"
    )


def agreed(hosts: list[str], world_size: int, device) -> list[str]:
    """The ranks' host names (in rank order), once their software agrees: each rank's runtime
    and versions, and its image, all_gathered and compared with rank 0's, kept per host for
    train_summary.json (agree). A collective: every rank calls it."""
    from ddpflow.cluster.distenv import all_gather_text

    runtime, image = runtime_here()
    line = json.dumps([runtime, *(rank_versions()[key] for key in FIELDS)])
    gathered = all_gather_text(line, world_size, device)
    images = all_gather_text(image or "-", world_size, device)  # "-": no image (no empty text)
    agree(hosts, gathered, [None if text == "-" else text for text in images])
    return hosts


def agree(hosts: list[str], lines: list[str], images: list[str | None]) -> None:
    """Every rank's line (agreed) and image: refused where the ranks' versions
    differ from each other, naming the first rank that differs from rank 0; else kept in SEEN
    per host for train_summary.json."""
    rows = [json.loads(line) for line in lines]
    first = dict(zip(FIELDS, rows[0][1:], strict=True))
    for rank, row in enumerate(rows):
        mine = dict(zip(FIELDS, row[1:], strict=True))
        if fields := changed(mine, first):
            sides = "; ".join(
                f"{NAMES[key]} {mine[key]} on rank {rank} ({hosts[rank]}), {first[key]} on "
                f"rank 0 ({hosts[0]})"
                for key in fields
            )
            raise SoftwareMismatch(
                f"the ranks run different software: {sides}; every node must run the same "
                "image (machine.container) or environment (machine.setup)"
            )
    SEEN.clear()
    for rank, (host, row, image) in enumerate(zip(hosts, rows, images, strict=True)):
        entry = SEEN.setdefault(host, {"runtime": row[0], "image": image, "ranks": []})
        entry["ranks"].append(rank)
        entry.update(zip(FIELDS, row[1:], strict=True))


def record() -> dict[str, dict[str, Any]]:
    """train_summary.json's "software": per host, the runtime and image its ranks ran in and
    their versions."""
    return {host: dict(entry) for host, entry in SEEN.items()}
