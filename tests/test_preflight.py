"""Preflight communication check on 2 real gloo ranks: passes under a low threshold, fails
naming the slow rank and its host above what the link can do; and bus_bandwidth, the
nccl-tests formula it judges by."""

from __future__ import annotations

import pytest
import torch
from ddpflow.checks.links import SlowInterconnect, bus_bandwidth, run_preflight
from distributed_helpers import run_group


def _preflight(env, threshold):
    cfg = {"enabled": True, "min_busbw_gbps": threshold, "megabytes": 1, "iters": 3}
    hosts = [f"host{r}" for r in range(env.world_size)]
    try:
        return ("ok", run_preflight(cfg, env, torch.device("cpu"), hosts))
    except SlowInterconnect as exc:
        return ("slow", str(exc))


def _both(env):
    return [_preflight(env, 1e-6), _preflight(env, 1e6)]


def test_preflight_passes_and_fails_by_threshold(tmp_path):
    rank0, rank1 = run_group(2, _both, (), tmp_path)
    (status, result), (slow_status, message) = rank0
    assert status == "ok" and result["all_reduce_busbw_gbps"] > 0
    assert set(result["link_gbps"]) == {1}
    assert slow_status == "slow"
    assert "min_busbw_gbps=1000000.0" in message and "rank 1 on host1" in message
    # only rank 0 judges; the other ranks return their measurements without raising
    assert [status for status, _ in rank1] == ["ok", "ok"]


def test_bus_bandwidth_follows_nccl_tests():
    algbw, busbw = bus_bandwidth(2e9, 1.0, 4, "all_reduce")
    assert algbw == pytest.approx(2.0)
    assert busbw == pytest.approx(2.0 * 2 * 3 / 4)
    assert bus_bandwidth(1e9, 0.5, 8, "allreduce") == pytest.approx((2.0, 2.0 * 14 / 8))
    for name in ("broadcast", "reduce"):
        assert bus_bandwidth(3e9, 2.0, 8, name) == pytest.approx((1.5, 1.5))
    assert bus_bandwidth(1e9, 1.0, 4, "all_gather") == pytest.approx((1.0, 0.75))
    assert bus_bandwidth(1e9, 1.0, 1, "all_reduce") == pytest.approx((1.0, 0.0))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((1e6, 0.0, 2, "all_reduce"), "seconds"),
        ((1e6, 1.0, 0, "all_reduce"), "world_size"),
        ((1e6, 1.0, 2, "gather"), "unknown collective"),
    ],
)
def test_bus_bandwidth_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        bus_bandwidth(*args)
