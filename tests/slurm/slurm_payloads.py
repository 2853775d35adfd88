"""Code that runs ON the test cluster's nodes (not a test module).

It lives in an importable module on purpose: submitit pickles a function by
reference (module + name), so the job must be able to `import slurm_payloads`;
the test puts this directory on PYTHONPATH in the sbatch script
(`slurm_setup`).  Run as a script it is the gloo all_reduce check.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys


def task_info() -> dict[str, str]:
    """What one Slurm task sees (returned to the submitter through submitit)."""
    keys = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID")
    info = {key: os.environ.get(key, "") for key in keys}
    info["hostname"] = socket.gethostname()
    return info


def master_addr() -> str:
    """First host of the allocation: rank 0 runs there with srun's block layout."""
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    ).stdout
    return out.split()[0]


def allreduce_main() -> int:
    """Every rank contributes rank+1; all must see 1+2+...+world."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    # A port derived from the job id: concurrent jobs on a node do not collide.
    port = 20000 + int(os.environ["SLURM_JOB_ID"]) % 20000
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master_addr()}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    print(f"rank={rank} world={world} host={socket.gethostname()} sum={value.item():g}", flush=True)
    dist.destroy_process_group()
    return 0 if value.item() == expected else 1


def rendezvous_listeners(folder: str) -> dict:
    """A rank of a ddpflow job: the rendezvous through `folder` (distenv, as TrainTask), one
    all_reduce, the host names gathered as tensors, then the listening sockets this rank
    holds in its node's network namespace."""
    import torch
    import torch.distributed as dist
    from ddpflow.cluster import distenv
    from distributed_helpers import own_listeners

    env = distenv.discover()
    distenv.init_process_group(env, "gloo", 60, folder)
    value = torch.ones(1)
    dist.all_reduce(value)
    hosts = distenv.all_gather_text(socket.gethostname(), env.world_size, torch.device("cpu"))
    dist.barrier()
    listeners = own_listeners()
    dist.barrier()
    distenv.leave_together(env)
    return {"rank": env.rank, "host": socket.gethostname(), "hosts": hosts,
            "listeners": listeners, "sum": value.item()}  # fmt: skip


if __name__ == "__main__":
    sys.exit(allreduce_main())
