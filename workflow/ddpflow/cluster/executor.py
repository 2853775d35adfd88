"""submitit's executor for a job: local processes, or a Slurm batch job (its sbatch
parameters from the run's machine section, a nested allocation's variables hidden while it
is submitted, a training job's supervisor in front of its srun: ddpflow.cluster.in_job).

    executor = make_executor("slurm", run["machine"], folder, "ddpflow-train-cnn")
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import submitit

from ddpflow.cluster import container, in_job, private
from ddpflow.config.machine import memory_mb, ranks_per_node


def slurm_parameters(machine: dict, job_name: str, exclude=(), folder=None) -> dict:
    """submitit SlurmExecutor parameters for a run's `machine` section; exclude: nodes the
    job must not run on (the bad-node ledger's, ddpflow.cluster.placement), added to any
    `exclude` of machine.sbatch_extra; folder: the job's folder, which the batch script
    checks is private before the node loads the job's pickle from it (cluster.private)."""
    cpus = machine["cpus_per_task"]
    extra = dict(machine["sbatch_extra"])
    if exclude:
        extra["exclude"] = ",".join(filter(None, [extra.get("exclude"), *exclude]))
    params = {
        "job_name": job_name,
        "nodes": machine["nodes"],
        "ntasks_per_node": ranks_per_node(machine),
        "cpus_per_task": cpus,
        "mem": f"{memory_mb(machine)}M",
        "time": machine["time_min"],
        "partition": machine["partition"],
        "signal_delay_s": 120,
        # Slurm >= 22.05: srun no longer inherits --cpus-per-task from the allocation, and
        # one dead rank must end the step instead of leaving the others blocked.
        "srun_args": [f"--cpus-per-task={cpus}", "--kill-on-bad-exit=1"],
        "setup": [private.job_refusal_script(folder)] if folder else [],
        "additional_parameters": extra,
        "stderr_to_stdout": False,
    }
    params["setup"] += list(machine["setup"])  # the job folder's check first
    # machine.container: pyxis's srun options, ch-run's $USER (ddpflow.cluster.container)
    params["srun_args"] += container.srun_args(machine)
    params["setup"] += container.setup_lines(machine)
    if machine["gpus_per_node"]:
        params["gpus_per_node"] = machine["gpus_per_node"]
    for key in ("account", "qos", "constraint"):
        if machine[key]:
            params[key] = machine[key]
    return params


def make_executor(
    launcher: str,
    machine: dict,
    folder: str | Path,
    job_name: str,
    max_requeues: int = 3,
    exclude=(),
    supervised: in_job.InJob | None = None,
):
    """supervised: the job restarts its ranks inside its allocation (ddpflow.cluster.in_job)."""
    python = container.python_command(machine, launcher)  # None: this process's Python
    if launcher == "local":
        local = submitit.LocalExecutor(folder=str(folder), python=python)
        local.update_parameters(
            nodes=1,
            tasks_per_node=ranks_per_node(machine),
            gpus_per_node=machine["gpus_per_node"],
            timeout_min=machine["time_min"],
            setup=container.setup_lines(machine),
        )
        return local
    # max_num_timeout: requeues after hitting the time limit (preemptions are not counted)
    params = slurm_parameters(machine, job_name, exclude, folder)
    if supervised is None:
        executor = submitit.SlurmExecutor(str(folder), max_num_timeout=max_requeues, python=python)
    else:
        params = in_job.slurm_parameters(params, supervised)
        executor = in_job.Executor(
            str(folder), supervised, max_num_timeout=max_requeues, python=python
        )
    executor.update_parameters(**params)
    return executor


@contextlib.contextmanager
def clean_slurm_environment():
    """Hide an outer allocation's variables while submitting: sbatch and srun read SLURM_*
    (SLURM_MEM_PER_CPU, SLURM_NTASKS, ...) and a nested job would inherit the wrong shape;
    MASTER_*/RANK/WORLD_SIZE and SUBMITIT_* would mislead the new job's rank discovery.
    submitit.helpers.clean_env hides all of those (SLURM_, SLURMD_, SRUN_, SBATCH_, SUBMITIT_,
    the torch.distributed names); salloc's SALLOC_* it misses are passed by name."""
    salloc = [key for key in os.environ if key.startswith("SALLOC_")]
    with submitit.helpers.clean_env(extra_names=salloc):
        yield
