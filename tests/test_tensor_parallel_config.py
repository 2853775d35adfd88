"""train.tensor_parallel on the login node (no process group): the refusals made before
anything is submitted, the batch arithmetic over the data-parallel ranks (world size /
tensor_parallel), the fingerprints (a machine setting: nothing retrains), the memory
estimate's tensor share (checked against the runtime's own split on a fake 2-rank group),
and `python -m ddpflow plan` over the data-parallel ranks."""

from __future__ import annotations

import pytest
import torch
import yaml
from ddpflow import plan
from ddpflow.checks import memory
from ddpflow.checks.batch import check_batch_fits
from ddpflow.checks.tensor_parallel import split_parameters
from ddpflow.checks.values import run_warnings
from ddpflow.config import ConfigError
from ddpflow.config.fingerprint import config_hash, evaluation_fingerprint, training_fingerprint
from ddpflow.config.machine import accumulation_steps, data_parallel_size
from workflow_helpers import make_run

TEXT = {"source": "text", "path": "corpus.txt"}
SPLIT = ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.0.weight", "mlp.0.bias")
SPLIT += ("mlp.2.weight",)


def _lm(train=None, machine=None, model=None, **top) -> dict:
    """A resolved gpt run on 4 CPU ranks of one node: global batch 8, micro-batch 2."""
    return make_run(
        task="language_model",
        data=TEXT,
        model={"name": "gpt", **(model or {})},
        train={"global_batch_size": 8, "micro_batch_size": 2, **(train or {})},
        machine={"cpu_ranks_per_node": 4, **(machine or {})},
        **top,
    )


@pytest.mark.parametrize(
    "sections, message",
    [
        (
            {"train": {"tensor_parallel": 4}, "model": {"kwargs": {"n_head": 6}}},
            "train.tensor_parallel 4 does not divide model.kwargs.n_head 6: each rank of a tensor "
            "group computes whole heads; set train.tensor_parallel to a divisor of 6 (1, 2, 3, "
            "6), or model.kwargs.n_head to a multiple of 4",
        ),
        (
            {"train": {"tensor_parallel": 3}, "machine": {"cpu_ranks_per_node": 6}},
            "train.tensor_parallel 3 does not divide model.kwargs.n_head 4 (gpt's default)",
        ),
        (
            {"train": {"tensor_parallel": 4}, "machine": {"cpu_ranks_per_node": 6}},
            "train.tensor_parallel 4 does not divide the 6 ranks of a node "
            "(machine.cpu_ranks_per_node 6): a tensor group's ranks are on one node; set "
            "train.tensor_parallel to a divisor of 6 (1, 2, 3, 6), or machine.cpu_ranks_per_node "
            "to a multiple of 4",
        ),
        (
            {"train": {"strategy": "zero"}},
            "train.strategy zero with train.tensor_parallel 2 "
            "is not supported yet (supported: ddp, fsdp); set train.strategy: ddp or fsdp",
        ),
        ({"train": {"strategy": "hsdp"}}, "train.strategy hsdp with train.tensor_parallel 2"),
        (
            {"train": {"precision": "fp16"}, "machine": {"gpus_per_node": 2}, "launcher": "slurm"},
            "train.precision fp16 with train.tensor_parallel 2: fp16's gradient scaler is not "
            "built for split (DTensor) gradients here; use train.precision: bf16",
        ),
        (
            {"train": {"compile": True}},
            "train.compile: true with train.tensor_parallel 2 is not "
            "supported yet; set train.compile: false, or train.tensor_parallel: 1",
        ),
    ],
)
def test_each_combination_it_does_not_support_is_refused_naming_the_fix(sections, message):
    train = {"tensor_parallel": 2, **sections.pop("train", {})}
    with pytest.raises(ConfigError) as refused:
        _lm(train=train, **sections)
    assert message in str(refused.value)


def test_a_model_other_than_gpt_is_refused():
    with pytest.raises(ConfigError) as refused:
        make_run(train={"tensor_parallel": 2}, machine={"cpu_ranks_per_node": 2})
    assert (
        "train.tensor_parallel 2 splits model gpt's attention and MLP projections, but "
        "model.name is 'cnn'; set train.tensor_parallel: 1, or model.name: gpt"
    ) in str(refused.value)


def test_a_node_the_degree_does_not_divide_is_refused_before_micro_batch_auto_resolves():
    with pytest.raises(ConfigError, match="does not divide the 4 ranks of a node"):
        _lm(train={"tensor_parallel": 8, "micro_batch_size": "auto"})


def test_the_data_parallel_ranks_split_the_global_batch():
    # 4 ranks in tensor groups of 2: 2 data-parallel ranks, 8 / (2 x 2) = 2 micro-batches each
    run = _lm(train={"tensor_parallel": 2})
    assert run["world_size"] == 4 and data_parallel_size(run["train"], 4) == 2
    assert accumulation_steps(run["train"], data_parallel_size(run["train"], 4)) == 2
    assert data_parallel_size({"global_batch_size": 8}, 4) == 4  # a run resolved before the key
    # 3 micro-batches: 3 ranks could not split them, 3 data-parallel ranks of 6 can
    _lm(train={"tensor_parallel": 2, "global_batch_size": 6}, machine={"cpu_ranks_per_node": 6})
    with pytest.raises(ConfigError) as refused:
        _lm(train={"tensor_parallel": 2, "global_batch_size": 6})
    assert (
        "but 2 data-parallel ranks (world size 4 / train.tensor_parallel 2; machine.nodes 1 x 4 "
        "ranks) do not divide 3 micro-batches: 1, 3 data-parallel ranks work; 2 do not"
    ) in str(refused.value)


def test_micro_batch_auto_resolves_for_the_data_parallel_ranks():
    # global 12 on 6 ranks: 6 ranks take micro-batches of 2; 3 data-parallel ranks take 4
    auto = {"global_batch_size": 12, "micro_batch_size": "auto"}
    machine = {"cpu_ranks_per_node": 6}
    assert _lm(train=auto, machine=machine)["train"]["micro_batch_size"] == 2
    run = _lm(train={**auto, "tensor_parallel": 2}, machine=machine)
    assert run["train"]["micro_batch_size"] == 4
    with pytest.raises(ConfigError) as refused:  # 5 samples: no 2 ranks split them
        _lm(train={**auto, "global_batch_size": 5, "tensor_parallel": 2})
    assert (
        "splits train.global_batch_size 5 evenly at 2 data-parallel ranks (machine.nodes 1 x 4 "
        "ranks per node / train.tensor_parallel 2): data-parallel ranks 1, 5 work. Change the "
        "machine or train.tensor_parallel"
    ) in str(refused.value)


def test_a_global_batch_larger_than_the_split_names_the_data_parallel_ranks():
    run = _lm(train={"tensor_parallel": 2})
    with pytest.raises(ConfigError, match=r"at most 4 \(a multiple of micro_batch_size 2 x 2 "):
        check_batch_fits(run, 7)  # the unit is micro x data-parallel ranks: 4, not 8


def test_ddp_settings_are_said_ignored_and_static_graph_is_not_refused():
    run = _lm(train={"tensor_parallel": 2, "ddp": {"static_graph": True}})  # 2 accumulation steps
    assert any(
        "train.ddp.static_graph set, but train.tensor_parallel 2 (strategy ddp) does not use "
        "DistributedDataParallel" in line
        for line in run_warnings(run, "slurm")
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_degree_changes_no_fingerprint(strategy):
    one = _lm(train={"strategy": strategy})
    two = _lm(train={"strategy": strategy, "tensor_parallel": 2})
    assert training_fingerprint(two) == training_fingerprint(one)
    assert config_hash(training_fingerprint(two)) == config_hash(training_fingerprint(one))
    assert evaluation_fingerprint(two) == evaluation_fingerprint(one)
    assert training_fingerprint(_lm(train={"optimizer": {"lr": 0.5}})) != training_fingerprint(one)


def _gpt_figures(kwargs: dict) -> tuple[dict, int, int]:
    """(figures of the whole gpt as footprint measures them, the parameter bytes the
    runtime's split leaves on one rank of a fake 2-rank tensor group, of them one block's)."""
    from ddpflow.training import tensor_parallel
    from ddpflow.training.gpt import gpt
    from ddpflow.training.sharding_plan import fake_world
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(2), torch.device("meta"):
        model = gpt(256, 64, kwargs)
        whole = sum(p.numel() * 4 for p in model.parameters())
        split = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith(SPLIT))
        block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
        tensor_parallel.parallelize(model, init_device_mesh("cpu", (2,)))
        local, block_local = (_local_bytes(m) for m in (model, model.blocks[0]))
    assert split == split_parameters(kwargs)[0] * 4  # counted by name, as the estimate counts
    figures = {
        "parameters": whole,
        "buffers": 0,
        "gradients": whole,
        "optimizer": 2 * whole,  # Adam's two moments
        "activations": 2**20,
        "activations_at_2": 2**18,
        "largest_unit": block,  # a GPT block: an FSDP unit
    }
    return figures, local, block_local


def _local_bytes(module: torch.nn.Module) -> int:
    """fp32 bytes of module's parameters as this rank holds them (a DTensor's local part)."""
    return sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in module.parameters()
    )


@pytest.mark.parametrize("kwargs", [{}, {"n_layer": 2, "n_embd": 96, "n_head": 6, "bias": False}])
def test_the_memory_estimate_holds_a_ranks_tensor_share(kwargs):
    """ddp: each rank of a group of 2 holds half of every block's projections (and their
    gradients and Adam moments); fsdp then shards that over the 2 data-parallel ranks."""
    figures, local, unit = _gpt_figures(kwargs)
    saved = figures["parameters"] - local
    process = {"anon": 0, "file": 0}
    one, two = (_lm(train={"tensor_parallel": t}, model={"kwargs": kwargs}) for t in (1, 2))
    full, share = (memory.estimate(r, figures, process, 0) for r in (one, two))
    assert (share.parameters, share.gradients) == (local, local)
    assert abs(share.optimizer - 2 * local) <= 1
    assert abs((full.total - share.total) - 4 * saved) <= 1  # activations kept whole
    gpu = {**two, "machine": {**two["machine"], "gpus_per_node": 4}}
    fsdp = {**gpu, "train": {**gpu["train"], "strategy": "fsdp"}}
    est = memory.estimate(fsdp, figures, process, 0)
    assert est.parameters == -(-local // 2) + 2 * unit  # half its share, two units gathered
    assert est.gradients == -(-local // 2) + unit


def test_plan_counts_the_data_parallel_ranks(tmp_path):
    cfg = {
        "task": "language_model",
        "data": {"source": "text", "path": "corpus", "block_size": 64},
        "model": {"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 2, "n_embd": 64}},
        "train": {"global_batch_size": 64, "micro_batch_size": 2, "strategy": "fsdp",
                  "tensor_parallel": 2},
        "results_dir": str(tmp_path / "results"),
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    doc = plan.plan(str(path), 2, 4)  # 8 ranks, 4 data-parallel ranks of 8 micro-batches
    assert (doc["world_size"], doc["tensor_parallel"], doc["data_parallel_size"]) == (8, 2, 4)
    assert doc["micro_batches"]["per_rank"] == 8 and len(doc["micro_batches"]["by_rank"]) == 4
    assert sorted(sum(doc["micro_batches"]["by_rank"], [])) == list(range(32))
    assert set(doc["strategies"]) == {"ddp", "fsdp"} and doc["fsdp"]["mesh"]["shape"] == [4]
    assert "8 per data-parallel rank (of 4; tensor_parallel 2)" in plan.render(doc)
