"""`python -m ddpflow plan`: a cluster shape simulated in one process on torch's fake process
group (ddpflow.plan, ddpflow.training.sharding_plan). The layout at 64, 256 and 1,024 ranks,
the JSON's keys, every micro-batch of a step computed exactly once, the checkpoint's readers
after a resume at another size, a bad shape refused early, and the plan's per-rank memory
against a real 4-rank gloo run of the same model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from ddpflow import plan
from ddpflow.config import ConfigError
from ddpflow.training import sharding_plan as sp
from workflow_helpers import REPO

GPT = {"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 2, "n_embd": 64, "dropout": 0.0}}


def _config(tmp_path: Path, model=GPT, train=None, **top) -> Path:
    cfg = {
        "task": "language_model",
        "data": {"source": "text", "path": "corpus", "block_size": 64},
        "model": model,
        "train": {"global_batch_size": 2048, "micro_batch_size": 2, "strategy": "fsdp",
                  **(train or {})},
        "results_dir": str(tmp_path / "results"),
        **top,
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("nodes, per_node", [(8, 8), (32, 8), (128, 8)])
def test_a_plan_at_64_256_and_1024_ranks(tmp_path, nodes, per_node):
    doc = plan.plan(str(_config(tmp_path)), nodes, per_node)
    world = nodes * per_node
    assert doc["world_size"] == world and doc["fsdp"]["mesh"]["shape"] == [world]
    assert (
        doc["strategy"] == "fsdp" and doc["peak_bytes"] == doc["strategies"]["fsdp"]["peak_bytes"]
    )
    for part in doc["strategies"].values():
        assert part["peak_bytes"]["rank_0"] >= part["peak_bytes"]["other_ranks"] > 0
    # ddp holds every state whole, zero shards the optimizer state, fsdp shards it all
    peaks = {s: doc["strategies"][s]["parts"] for s in ("ddp", "zero", "fsdp")}
    assert peaks["ddp"]["optimizer"] > peaks["zero"]["optimizer"] >= peaks["fsdp"]["optimizer"]
    assert [u["name"] for u in doc["fsdp"]["units"]] == ["blocks.0", "blocks.1", "(root)"]
    # a rank's shards: at least the even split (FSDP pads each parameter's rows)
    assert doc["fsdp"]["parameter_bytes_per_rank"] >= doc["fsdp"]["even_split_bytes"]
    json.dumps(doc)  # JSON-ready


def test_an_hsdp_plan_at_1024_ranks_shards_within_a_node(tmp_path):
    """strategy hsdp at 128 x 8: the mesh is 128 replicas x 8 shards (a node's ranks), a
    rank holds an eighth of the model (not a 1,024th), and its memory lies between fsdp's
    and ddp's; after a resume at 64 nodes a rank reads only its own shard's file."""
    doc = plan.plan(str(_config(tmp_path, train={"strategy": "hsdp"})), 128, 8)
    mesh = doc["fsdp"]["mesh"]
    assert mesh == {"shape": [128, 8], "names": ["replicate", "shard"]}
    assert (
        doc["strategy"] == "hsdp" and doc["peak_bytes"] == doc["strategies"]["hsdp"]["peak_bytes"]
    )
    whole = doc["fsdp"]["parameter_bytes_whole"]
    assert whole / 8 <= doc["fsdp"]["parameter_bytes_per_rank"] < whole / 4
    parts = {s: doc["strategies"][s]["parts"] for s in ("ddp", "fsdp", "hsdp")}
    assert parts["ddp"]["optimizer"] > parts["hsdp"]["optimizer"] > parts["fsdp"]["optimizer"]
    ckpt = doc["checkpoint"]
    assert ckpt["reads_from_means"] == "shard index" and ckpt["resume_world_size"] == 512
    assert all(r["reads_from"] == [r["rank"] % 8] for r in ckpt["reads"])


def test_each_micro_batch_of_a_step_is_computed_by_exactly_one_rank():
    for micro_batches, world in ((2048, 1024), (1024, 1024), (12, 4), (12, 3)):
        shares = sp.micro_batch_shares(micro_batches, world)
        flat = [j for share in shares for j in share]
        assert sorted(flat) == list(range(micro_batches)), (micro_batches, world)
        assert {len(share) for share in shares} == {micro_batches // world}


def test_the_shards_are_what_fully_shard_gives_every_rank():
    """rank_rows (the plan's rows of rank r) against a model really sharded as rank r."""
    model, shape, vocab = GPT, [64], 257
    mesh = sp.MeshSpec.for_strategy("fsdp", 1, 96)  # 96 ranks: wpe's 64 rows leave some empty
    for rank in (0, 1, 63, 95):
        with sp.fake_world(mesh.world, rank), torch.device("meta"):
            from ddpflow.training.models import build_model
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            m = build_model(model, shape, vocab)
            fully_shard(m, mesh=init_device_mesh("cpu", mesh.shape))
            local = {n: p.to_local().shape[0] for n, p in m.named_parameters()}
            rows = {n: p.shape[0] for n, p in m.named_parameters()}
        for name, count in local.items():
            assert sp.rank_rows(rows[name], mesh, rank)[1] == count, (name, rank)


def test_after_a_resume_at_half_the_ranks_each_reads_the_files_holding_its_rows():
    sizes = {"a": (1024, 4, 4), "b": (10, 8, 4), "c": (1000, 4, 4)}
    old, new = sp.MeshSpec((8,), ("shard",)), sp.MeshSpec((4,), ("shard",))
    reads = sp.resharding_reads(sizes, old, new)
    # a: 128 rows per old rank, 256 per new -> new rank r reads 2r and 2r+1; b: old ranks
    # hold 2 rows (rank 5 none), new 3: new rank 1 rows 3-5 -> old ranks 1 and 2
    assert reads[0]["reads_from"] == [0, 1] and reads[1]["reads_from"] == [1, 2, 3]
    assert sum(r["bytes"] for r in reads) == 1024 * 4 + 10 * 8 + 1000 * 4  # every row once
    every = {o for r in reads for o in r["reads_from"]}
    assert every == set(range(8))  # no file is left unread


def test_the_command_prints_a_table_and_writes_the_json(tmp_path):
    out = tmp_path / "plan.json"
    command = [sys.executable, "-m", "ddpflow", "plan", "--configfile", str(_config(tmp_path)),
               "--nodes", "8", "--gpus-per-node", "8", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "64 ranks" in done.stdout and "fsdp" in done.stdout
    # the parts of the run's own strategy's peak, with the knobs of the batch-sized ones
    assert re.search(r"rank 0 GiB: parameters [\d.]+, .*evaluation [\d.]+ \(eval.batch_size "
                     r"\d+\)", done.stdout), done.stdout  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 64
    assert set(doc["peak_bytes"]) == {"rank_0", "other_ranks"}
    assert doc["checkpoint"]["resume_world_size"] == 32 and len(doc["checkpoint"]["reads"]) == 32


def test_a_shape_that_does_not_divide_the_step_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="global_batch_size"):
        plan.plan(str(_config(tmp_path, train={"global_batch_size": 96})), 8, 8)


def _rank_peak(env, run: dict) -> dict:
    """On a real gloo rank: the process before the model, then training as the ranks do;
    its peak resident memory less the libraries' pages (what the estimate counts)."""
    from ddpflow.config.typed import RunSpec
    from ddpflow.runtime import peak_rss_bytes
    from ddpflow.training import footprint
    from ddpflow.training.loop import Loop, fit
    from ddpflow.training.models import build_model
    from distributed_helpers import make_data
    from memory_probe import rss_file_bytes

    process = footprint.process_memory()
    data = make_data(96, 16)
    torch.manual_seed(0)
    model = build_model(run["model"], data.shape, 4)
    loop = Loop(RunSpec.from_run(run), data, env, torch.device("cpu"), model)
    fit(loop, lambda record: None)
    return {"own_peak": peak_rss_bytes() - rss_file_bytes(), "process": process}


@pytest.mark.slow
def test_the_plans_per_rank_memory_is_within_a_quarter_of_a_real_4_rank_run(tmp_path):
    from distributed_helpers import run_group
    from workflow_helpers import make_run

    model = {"name": "mlp", "mlp_hidden": [4096, 4096]}  # 17M parameters: the state leads
    train = {"global_batch_size": 32, "micro_batch_size": 8, "epochs": 1, "progress": False,
             "strategy": "fsdp", "optimizer": {"name": "adamw"}}  # fmt: skip
    data = {"source": "synthetic", "synthetic": {"channels": 1, "height": 8, "width": 8,
                                                 "num_classes": 4}}  # fmt: skip
    config = _config(tmp_path, model=model, train=train, task="classification", data=data,
                     machine={"cpu_ranks_per_node": 4}, eval={"batch_size": 16})  # fmt: skip
    doc = plan.plan(str(config), 1, 0)
    run = make_run(model=model, train=train, machine={"cpu_ranks_per_node": 4})
    got = run_group(4, _rank_peak, (run,), tmp_path / "rv")
    planned = doc["peak_bytes"]
    for rank, measured in enumerate(got):
        want = planned["rank_0" if rank == 0 else "other_ranks"]
        assert abs(want / measured["own_peak"] - 1) < 0.25, (
            rank,
            want,
            measured,
            doc["strategies"],
        )
