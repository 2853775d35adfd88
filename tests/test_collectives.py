"""ddpflow.tutorial.collectives against torch.distributed's own collectives on real gloo groups.

Starting a process group costs seconds (spawn + import torch + rendezvous), so each
world size is launched once, every case runs inside the workers, and the workers
return their failures; the tests below only read those results.
"""

from __future__ import annotations

import datetime
import itertools
import queue
import time
import traceback
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ddpflow.tutorial import collectives as C

# slow: real process groups or subprocesses for seconds each; make test-fast leaves it out
pytestmark = pytest.mark.slow

WORLD_SIZES = (2, 3, 4)
NUMELS = (0, 1, 5, 1001)  # 5 and 1001 divide by none of 2, 3, 4; 0 and 1 are < n
DTYPES = (torch.float32, torch.float64, torch.int64)
OPS = ("sum", "product", "max", "min")
COLLECTIVES = ("broadcast", "reduce", "naive_all_reduce", "ring_all_reduce")
TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
COMM_TIMEOUT_S = 30  # a deadlocked send/recv fails after this instead of hanging
LAUNCH_TIMEOUT_S = 150


# --- worker side -------------------------------------------------------------------


def _cases(world_size):
    """Every (collective, root, op) to run, identical on all ranks (same order!).

    Each point-to-point message costs ~1-3 ms with gloo on a busy 2-core machine, so
    the grid is pruned where cases are redundant: reduce takes every dst with "sum"
    and every op at one non-zero dst (the op only changes the local fold).
    """
    roots = range(world_size)
    yield from (("broadcast", r, None) for r in roots)
    yield from (("reduce", r, "sum") for r in roots)
    yield from (("reduce", world_size - 1, op) for op in OPS if op != "sum")
    yield from (("naive_all_reduce", None, op) for op in OPS)
    yield from (("ring_all_reduce", None, op) for op in OPS)


def _grid(world_size):
    """(collective, root, op, numel, dtype, layout) for every case.

    Non-contiguous inputs are tried in int64 only: staging is dtype-independent and
    exact comparison catches any element landing in the wrong place.
    """
    for (collective, root, op), numel in itertools.product(_cases(world_size), NUMELS):
        for dtype in DTYPES:
            yield collective, root, op, numel, dtype, "contiguous"
        yield collective, root, op, numel, torch.int64, "strided"


def _input(seed, rank, numel, dtype):
    gen = torch.Generator().manual_seed(seed * 16 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    # small ints: the product over 4 ranks stays far from int64 overflow
    return torch.randint(-3, 4, (numel,), generator=gen, dtype=dtype)


def _layout(x, layout):
    """(ours, ref): equal values, ours possibly non-contiguous, ref always contiguous."""
    if layout == "contiguous":
        return x.clone(), x.clone()
    if x.numel() == 1001:  # 2-D transposed view, strides (1, 143)
        ref = x.reshape(143, 7)
        return ref.t().contiguous().t(), ref.clone()
    base = torch.zeros(x.numel(), 2, dtype=x.dtype)
    base[:, 0] = x
    return base[:, 0], x.clone()  # every other element: stride 2


def _check(ours, expected):
    if expected.dtype.is_floating_point:
        torch.testing.assert_close(ours, expected)
    else:
        assert torch.equal(ours, expected), f"{ours} != {expected}"


def _run_case(rank, collective, root, op, x, layout):
    """Run ours on a copy and torch's on another; return (ours, expected) to compare."""
    ours, ref = _layout(x, layout)
    untouched = ref.clone()
    if collective == "broadcast":
        C.broadcast(ours, root)
        dist.broadcast(ref, root)
    elif collective == "reduce":
        C.reduce(ours, root, op)
        dist.reduce(ref, root, TORCH_OPS[op])
        if rank != root:  # ours promises to leave non-destination inputs alone
            ref = untouched
    elif collective == "naive_all_reduce":
        C.naive_all_reduce(ours, TORCH_OPS[op])  # also exercises the ReduceOp spelling
        dist.all_reduce(ref, TORCH_OPS[op])
    else:
        C.ring_all_reduce(ours, op)
        dist.all_reduce(ref, TORCH_OPS[op])
    return ours, ref


def _main_cases(rank, world_size, counts, failures):
    for seed, (collective, root, op, numel, dtype, layout) in enumerate(_grid(world_size)):
        what = f"{collective} root={root} op={op} numel={numel} {dtype} {layout} rank={rank}"
        try:
            x = _input(seed, rank, numel, dtype)
            ours, expected = _run_case(rank, collective, root, op, x, layout)
            if layout == "strided" and numel > 1:
                assert not ours.is_contiguous(), "layout did not make a strided view"
            _check(ours, expected)
        except AssertionError as exc:  # a wrong result: record it, the group is still in step
            failures.append((collective, what, repr(exc)[:500]))
        counts[collective] += 1


def _subgroup_cases(rank, world_size, counts, failures):
    """On group ranks 1..n-1, where group rank != global rank; rank 0 is a non-member."""
    members = list(range(1, world_size))
    group = dist.new_group(members)  # collective over the world: every rank calls it
    for seed, (numel, dtype) in enumerate(itertools.product(NUMELS, DTYPES)):
        x = _input(1000 + seed, rank, numel, dtype)
        ours = [x.clone() for _ in range(3)]
        C.broadcast(ours[0], 0, group)
        C.reduce(ours[1], len(members) - 1, "sum", group)
        C.ring_all_reduce(ours[2], "max", group)
        try:
            if rank in members:
                refs = [x.clone() for _ in range(3)]
                dist.broadcast(refs[0], members[0], group)
                dist.reduce(refs[1], members[-1], dist.ReduceOp.SUM, group)
                dist.all_reduce(refs[2], dist.ReduceOp.MAX, group)
                if rank != members[-1]:
                    refs[1] = x
            else:
                refs = [x, x, x]  # non-members must be left untouched
            for got, want in zip(ours, refs, strict=True):
                _check(got, want)
        except AssertionError as exc:
            failures.append(("subgroup", f"numel={numel} {dtype} rank={rank}", repr(exc)[:500]))
        counts["subgroup"] += 1


def _worker(rank, world_size, init_method, results):
    torch.set_num_threads(1)  # n workers on 2 cores: intra-op threads only contend
    counts, failures = Counter(), []
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COMM_TIMEOUT_S),
        )
        _main_cases(rank, world_size, counts, failures)
        _subgroup_cases(rank, world_size, counts, failures)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - e.g. a hang that hit the timeout: the group is unusable, stop
        failures.append(("fatal", f"rank={rank}", traceback.format_exc()))
    results.put({"rank": rank, "counts": dict(counts), "failures": failures})


# --- test side ---------------------------------------------------------------------


def _start(world_size, tmp_dir):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"file://{tmp_dir / 'rendezvous'}"
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, init_method, results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    return procs, results


def _collect(world_size, procs, results, deadline):
    try:
        return [results.get(timeout=max(1.0, deadline - time.monotonic())) for _ in procs]
    except queue.Empty:
        codes = [proc.exitcode for proc in procs]
        return [{"rank": -1, "counts": {}, "failures": [("fatal", "", f"no result: {codes}")]}]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    """{world_size: per-rank results}. All groups run at once: most of a case's time
    is spent waiting on message latency, so the groups overlap well even on 2 cores."""
    started = {ws: _start(ws, tmp_path_factory.mktemp(f"ws{ws}")) for ws in WORLD_SIZES}
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    return {ws: _collect(ws, *started[ws], deadline) for ws in WORLD_SIZES}


@pytest.mark.parametrize("collective", (*COLLECTIVES, "subgroup"))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matches_torch_distributed(group_results, world_size, collective):
    ranks = group_results[world_size]
    fatal = [f for r in ranks for f in r["failures"] if f[0] == "fatal"]
    assert not fatal, "\n".join(f[2] for f in fatal)
    ran = sum(r["counts"].get(collective, 0) for r in ranks)
    assert ran > 0, "no cases ran"
    failures = [f for r in ranks for f in r["failures"] if f[0] == collective]
    shown = "\n".join(f"{what}: {err}" for _, what, err in failures[:20])
    assert not failures, f"{len(failures)}/{ran} cases failed:\n{shown}"


@pytest.mark.parametrize("function", [C.reduce, C.naive_all_reduce, C.ring_all_reduce])
def test_unknown_op_rejected_before_any_communication(function):
    # No process group exists in this process: a ValueError (not a "default process
    # group has not been initialized" RuntimeError) shows op is validated first.
    args = (torch.zeros(3), 0) if function is C.reduce else (torch.zeros(3),)
    with pytest.raises(ValueError, match="unsupported reduction op"):
        function(*args, op="xor")
