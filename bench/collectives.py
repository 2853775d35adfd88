"""All-reduce benchmark in the style of nccl-tests: torch.distributed vs ddpflow's own.

For each backend (gloo always; nccl when >= 2 GPUs are visible) and world size, the
workers time, for message sizes from --min-bytes to --max-bytes (x4 steps):

* ``torch``: ``torch.distributed.all_reduce`` (the backend's native algorithm),
* ``ring``:  ``ddpflow.tutorial.collectives.ring_all_reduce`` (point-to-point ring),
* ``naive``: ``ddpflow.tutorial.collectives.naive_all_reduce`` (tree reduce + broadcast),

each ``--warmup`` untimed then ``--iters`` timed iterations. Every iteration starts
from the same input behind a barrier; its time is the slowest rank's, and the
reported time is the median over iterations. algbw = bytes / time, busbw = algbw *
2(n-1)/n (nccl-tests' all-reduce convention). Results go to a table on stdout and to
JSON (--out). Workers are separate ``python this-file --worker ...`` processes, so
the benchmark behaves the same whether run as a script or called via ``main()``.

    python bench/collectives.py --max-bytes 16MB
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import harness
import torch
import torch.distributed as dist
import workers
from ddpflow.checks.links import bus_bandwidth
from ddpflow.tutorial.collectives import naive_all_reduce, ring_all_reduce

IMPLS = ("torch", "ring", "naive")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
CPU_MAX_BYTES = 64 << 20  # gloo on CPU: 256 MB x 3 impls x iterations takes minutes
GPU_MAX_BYTES = 256 << 20
WORKER_TIMEOUT_S = 3600


def parse_bytes(text: str) -> int:
    """'1KB', '64M', '256MiB', '4096' -> bytes; K/M/G are binary, as in nccl-tests."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 1KB, 64MB)")
    return int(match[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[match[2].upper()]


def human(nbytes: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}B"
    return f"{nbytes}B"


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "collectives.json", worker=True)
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1KB"))
    p.add_argument(
        "--max-bytes",
        type=parse_bytes,
        default=None,
        help="largest message (default 64MB for gloo/CPU, 256MB for nccl)",
    )
    p.add_argument("--step-factor", type=int, default=4, help="size multiplier (default 4)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    p.add_argument("--backends", nargs="+", choices=("gloo", "nccl"), default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    return p.parse_args(argv)


# --- worker process ----------------------------------------------------------------


def _impl(name: str):
    if name == "torch":
        return lambda t: dist.all_reduce(t)
    return {"ring": ring_all_reduce, "naive": naive_all_reduce}[name]


def _time_impl(fn, src, buf, iters: int, warmup: int, sync) -> list[float]:
    """Per-iteration seconds of fn(buf) on this rank; buf is reset from src each time."""
    times = []
    for i in range(warmup + iters):
        buf.copy_(src)  # all-reduce is in place: restart from the same input
        sync()
        dist.barrier()  # start together, so the time is the collective's, not skew
        start = time.perf_counter()
        fn(buf)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _verify(src, dtype) -> bool:
    """Our two all-reduces agree with torch's on this input."""
    expected = src.clone()
    dist.all_reduce(expected)
    ok = True
    for fn in (ring_all_reduce, naive_all_reduce):
        got = fn(src.clone())
        if dtype.is_floating_point:
            ok &= torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
        else:
            ok &= torch.equal(got, expected)
    return bool(ok)


def _measure_size(nbytes: int, cfg: dict, device: torch.device, sync) -> dict:
    dtype = DTYPES[cfg["dtype"]]
    numel = nbytes // dtype.itemsize
    gen = torch.Generator().manual_seed(dist.get_rank())
    if dtype.is_floating_point:
        src = torch.rand(numel, generator=gen, dtype=dtype).to(device)
    else:
        src = torch.randint(0, 100, (numel,), generator=gen, dtype=dtype).to(device)
    row = {"bytes": numel * dtype.itemsize, "count": numel, "check_ok": _verify(src, dtype)}
    buf = torch.empty_like(src)
    for name in IMPLS:
        local = _time_impl(_impl(name), src, buf, cfg["iters"], cfg["warmup"], sync)
        slowest = torch.tensor(local, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # an iteration ends on its last rank
        seconds = statistics.median(slowest.tolist())
        algbw, busbw = bus_bandwidth(row["bytes"], seconds, cfg["world_size"], "all_reduce")
        row[name] = {"time_us": seconds * 1e6, "algbw_gbps": algbw, "busbw_gbps": busbw}
    return row


def run_worker(cfg: dict) -> int:
    rank, world_size, backend = cfg["rank"], cfg["world_size"], cfg["backend"]
    torch.set_num_threads(cfg["threads"])
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)  # batch_isend_irecv on NCCL needs the device set

        def sync():
            torch.cuda.synchronize(device)
    else:
        device = torch.device("cpu")

        def sync():
            pass

    init_method = f"file://{cfg['work']}/rendezvous"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        rows = [_measure_size(n, cfg, device, sync) for n in cfg["sizes"]]
    finally:
        dist.destroy_process_group()
    return workers.answer(cfg, rows)


# --- driver ------------------------------------------------------------------------


def launch(cfg: dict) -> list[dict]:
    """Run one (backend, world size) in fresh worker processes; rank 0's rows."""
    return workers.launch(__file__, cfg, WORKER_TIMEOUT_S)


def format_table(run: dict) -> str:
    head = f"# {run['backend']}, world size {run['world_size']}, {run['dtype']}, sum"
    lines = [
        head + f"; median of {run['iters']} iterations (after {run['warmup']} warmup)",
        f"{'size':>8} {'count':>10} "
        + " ".join(f"| {name + ' time(us)':>17} {'algbw':>7} {'busbw':>7}" for name in IMPLS)
        + " | check",
    ]
    for row in run["results"]:
        cells = " ".join(
            f"| {row[n]['time_us']:17.1f} {row[n]['algbw_gbps']:7.3f} {row[n]['busbw_gbps']:7.3f}"
            for n in IMPLS
        )
        check = "ok" if row["check_ok"] else "MISMATCH"
        lines.append(f"{human(row['bytes']):>8} {row['count']:>10} {cells} | {check}")
    lines.append("(algbw, busbw in GB/s = 1e9 B/s; busbw = algbw * 2(n-1)/n)")
    return "\n".join(lines)


def plan(args: argparse.Namespace) -> list[dict]:
    """One config per (backend, world size) that this machine can run."""
    gpus = torch.cuda.device_count()
    backends = args.backends or (["gloo", "nccl"] if gpus >= 2 else ["gloo"])
    configs = []
    for backend in backends:
        default_max = GPU_MAX_BYTES if backend == "nccl" else CPU_MAX_BYTES
        sizes = message_sizes(args.min_bytes, args.max_bytes or default_max, args.step_factor)
        for world_size in args.world_sizes:
            if backend == "nccl" and world_size > gpus:
                print(f"skipping nccl world size {world_size}: {gpus} GPU(s)", file=sys.stderr)
                continue
            threads = 1 if backend == "nccl" else max(1, (os.cpu_count() or 1) // world_size)
            configs.append(
                {
                    "backend": backend,
                    "world_size": world_size,
                    "dtype": args.dtype,
                    "iters": args.iters,
                    "warmup": args.warmup,
                    "sizes": sizes,
                    "threads": threads,
                }
            )
    return configs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args.worker)
    report = {
        **harness.head("all_reduce: torch.distributed vs ddpflow.tutorial.collectives (p2p)"),
        "conditions": {
            "timing": "per-iteration wall time after a barrier, slowest rank, median",
            "busbw": "algbw * 2(n-1)/n (nccl-tests all_reduce)",
            "op": "sum",
            "launch": "one process per rank, file:// rendezvous on this host",
        },
        "runs": [],
    }
    for cfg in plan(args):
        run = {**cfg, "results": launch(cfg)}
        report["runs"].append(run)
        print(format_table(run), flush=True)
    harness.write(report, args.out)
    failed = any(not row["check_ok"] for run in report["runs"] for row in run["results"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
