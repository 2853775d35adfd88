"""The staging job inside machine.container: a stage rule sent to Slurm (machine.stage.where:
job) runs Snakemake's own Python on the node, which starts the decoding in the image.

The Snakemake Slurm executor plugin submits the job, not ddpflow, so the container reaches
it through the environment: the Snakefile (workflow/rules/common.smk) exports each dataset's
staging machine section (export_staging_machines), in the main process and in the job's own;
the stage rule's function (ddpflow.pipeline.stage_data) asks staging_machine() and, in a Slurm
job outside any image, runs this module's main() inside it:

    <wrapper> python3 -m ddpflow.data.in_image '{"data": {...}, "out_dir": ..., "threads": 4}'

The rule's params (the data keys) stay what they were: a container changes no staged byte.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from ddpflow.cluster import container
from ddpflow.cluster.software import runtime_here
from ddpflow.errors import DataError

log = logging.getLogger(__name__)
STAGE_MACHINES = "DDPFLOW_STAGE_MACHINES"  # {dataset id: machine section with a container}


def export_staging_machines(runs: Iterable[dict], stage_where: str) -> None:
    """For the staging jobs: each dataset's machine section where it has a container (the
    first run of the dataset's, as its staging job's resources; ddpflow.config.machine)."""
    chosen: dict[str, dict] = {}
    for run in runs:
        if stage_where == "job" and container.of(run["machine"]) is not None:
            chosen.setdefault(run["dataset_id"], run["machine"])
    if chosen:
        os.environ[STAGE_MACHINES] = json.dumps(chosen)
    else:
        os.environ.pop(STAGE_MACHINES, None)


def staging_machine(out_dir: str | Path) -> dict | None:
    """The staged dataset's machine section when this process is a Slurm staging job outside
    any image whose run has machine.container; None: stage here."""
    if not os.environ.get("SLURM_JOB_ID") or runtime_here()[0] != "host":
        return None
    machines = json.loads(os.environ.get(STAGE_MACHINES) or "{}")
    return machines.get(Path(out_dir).name)


def stage(machine: dict, data_cfg: dict, out_dir: str, threads: int) -> dict:
    """Stage in the image (main() there); its output goes to this rule's log. Returns the
    manifest it wrote."""
    from ddpflow.data.staged import read_manifest

    out = str(Path(out_dir).absolute())
    binds = container.job_binds({"data": data_cfg, "machine": machine}, [out], out)
    machine = container.bound(machine, binds)
    container.make_mount_points(machine)
    job = json.dumps({"data": data_cfg, "out_dir": out, "threads": threads})
    argv = [*container.argv(machine), "-m", "ddpflow.data.in_image", job]
    spec = machine["container"]
    log.info("staging inside the %s image %s", spec["runtime"], container.image_path(spec))
    env = {**os.environ, "USER": os.environ.get("USER") or getpass.getuser()}  # ch-run needs it
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)
    for line in (done.stdout + done.stderr).splitlines():
        log.info("  image: %s", line)
    if done.returncode != 0:
        raise DataError(
            f"staging inside machine.container's image failed (exit {done.returncode}); its "
            f"output is above. The command: {' '.join(argv[:-1])} '<job>'"
        )
    return read_manifest(out)


def main(argv: list[str]) -> None:
    """Inside the image: stage as the rule would (ddpflow.data.staging)."""
    from ddpflow import runtime
    from ddpflow.data.staging import stage_dataset

    runtime.setup_logging()
    job = json.loads(argv[0])
    data = job["data"]
    stage_dataset(data, job["out_dir"], seed=data["seed"], threads=job["threads"])


if __name__ == "__main__":
    main(sys.argv[1:])
