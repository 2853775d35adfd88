"""Preflight communication check on 2 real gloo ranks: passes under a low threshold, fails
naming the slow rank and its host above what the link can do."""

from __future__ import annotations

import torch
from ddpflow.cluster.preflight import SlowInterconnect, run_preflight
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
