"""ddpflow.training.evaluate: unpadded shards and an exact distributed accuracy.

The distributed result is compared with a single-process evaluation of the same model on
real gloo groups of 2 and 3 ranks, on a test set of 1001 samples (divisible by neither).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from ddpflow.task import get_task
from ddpflow.training import evaluate
from ddpflow.training.evaluate import (
    Scoring,
    evaluate_split,
    shard_bounds,
    shard_counts,
    summarize,
)
from ddpflow.training.models import small_cnn
from ddpflow.training.rankdata import Split
from distributed_helpers import run_group
from torch.utils.data import DistributedSampler

N_TEST, NUM_CLASSES, BATCH = 1001, 10, 64  # 1001 = 7 * 11 * 13: 2 and 3 leave remainders
WORLD_SIZES = (1, 2, 3)


# --- shards -------------------------------------------------------------------------------


@pytest.mark.parametrize("world", range(1, 10))
def test_shards_partition_the_split(world):
    for n in [*range(0, 40), 1001, 10_000, 10_007]:
        bounds = [shard_bounds(n, world, rank) for rank in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        for (_, stop), (start, _) in zip(bounds, bounds[1:], strict=False):
            assert stop == start  # contiguous, disjoint, nothing skipped
        sizes = [stop - start for start, stop in bounds]
        assert sum(sizes) == n
        assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # the larger shards come first


def test_padding_sampler_would_over_count():
    """The pitfall evaluate.py avoids: DistributedSampler pads every rank to the same length,
    so per-rank totals summed over 3 ranks exceed the test set."""
    for n, world, padded in [(N_TEST, 3, 1002), (N_TEST, 2, 1002), (10_000, 3, 10_002)]:
        samplers = [DistributedSampler(range(n), world, r, shuffle=False) for r in range(world)]
        assert sum(len(s) for s in samplers) == samplers[0].total_size == padded > n
        seen = [i for s in samplers for i in s]
        assert len(seen) - len(set(seen)) == padded - n  # repeated samples counted twice
        ours = [shard_bounds(n, world, r) for r in range(world)]
        assert sum(stop - start for start, stop in ours) == n


# --- the model and test set, built once in the test process and sent to the ranks ---------


@pytest.fixture(scope="module")
def case():
    """A random small CNN (BatchNorm in eval mode) and 1001 8x8 images. 70% of the labels
    are the model's own predictions, so accuracy is far from both 0 and 1; samples whose
    top-2 logits are nearly tied are replaced, so float re-association from a different
    batch split cannot flip an argmax and exactness is a property of the counting."""
    torch.manual_seed(0)
    model = small_cnn(1, 4, NUM_CLASSES).eval()
    gen = torch.Generator().manual_seed(1)
    pool = torch.randint(0, 256, (2 * N_TEST, 1, 8, 8), dtype=torch.uint8, generator=gen)
    norm = (torch.full((1, 1, 1, 1), 0.5), torch.full((1, 1, 1, 1), 0.3))
    with torch.no_grad():
        logits = model(evaluate.normalize(pool, *norm))
    top2 = logits.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1] > 1e-3).nonzero().flatten()[:N_TEST]
    assert clear.numel() == N_TEST
    images, preds = pool[clear], logits[clear].argmax(dim=1)
    labels = torch.randint(0, NUM_CLASSES, (N_TEST,), generator=gen)
    keep = torch.rand(N_TEST, generator=gen) < 0.7
    labels[keep] = preds[keep]
    return {"state": model.state_dict(), "images": images, "labels": labels, "norm": norm}


def _reference(case) -> dict:
    """One forward over the whole set, plain Python counting: no shards, no collectives."""
    model = small_cnn(1, 4, NUM_CLASSES)
    model.load_state_dict(case["state"])
    model.eval()
    with torch.no_grad():
        logits = model(evaluate.normalize(case["images"], *case["norm"]))
        loss = torch.nn.functional.cross_entropy(logits.double(), case["labels"], reduction="sum")
    confusion = [[0] * NUM_CLASSES for _ in range(NUM_CLASSES)]
    for y, p in zip(case["labels"].tolist(), logits.argmax(dim=1).tolist(), strict=True):
        confusion[y][p] += 1
    correct = sum(confusion[c][c] for c in range(NUM_CLASSES))
    return {"confusion_matrix": confusion, "correct": correct, "loss": float(loss) / N_TEST}


def _evaluate_on_rank(env, case):
    model = small_cnn(1, 4, NUM_CLASSES)
    model.load_state_dict(case["state"])
    images, labels = case["images"], case["labels"]
    scoring = Scoring(get_task(), {"num_classes": NUM_CLASSES}, case["norm"], BATCH)
    result = evaluate_split(model, Split(images, labels), scoring, env)
    start, stop = shard_bounds(N_TEST, env.world_size, env.rank)
    local, _ = shard_counts(
        model, images[start:stop], labels[start:stop], NUM_CLASSES, BATCH, case["norm"]
    )
    result["local_total"] = int(local.sum())
    result["world"] = dist.get_world_size() if dist.is_initialized() else 1
    return result


@pytest.fixture(scope="module")
def results(case, tmp_path_factory):
    """{world size: per-rank results}; one process group per world size, started in turn."""
    out = {}
    for world in WORLD_SIZES:
        if world == 1:  # no process group: evaluate_split must not need one
            from ddpflow.cluster.distenv import discover

            out[1] = [_evaluate_on_rank(discover({}), case)]
        else:
            out[world] = run_group(
                world, _evaluate_on_rank, (case,), tmp_path_factory.mktemp("rdzv")
            )
    return out


@pytest.fixture(scope="module")
def reference(case):
    return _reference(case)


def test_reference_is_a_meaningful_test_set(reference):
    accuracy = reference["correct"] / N_TEST
    assert 0.5 < accuracy < 0.95
    assert sum(map(sum, reference["confusion_matrix"])) == N_TEST


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_distributed_accuracy_is_exactly_the_single_process_one(results, reference, world):
    ranks = results[world]
    assert [r["world"] for r in ranks] == [world] * world
    for result in ranks:  # every rank holds the summed counts, not just rank 0
        assert result["correct"] == reference["correct"]
        assert result["confusion_matrix"] == reference["confusion_matrix"]
        assert result["accuracy"] == reference["correct"] / N_TEST
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_sample_is_counted_once(results, world):
    ranks = results[world]
    for result in ranks:
        assert result["samples_evaluated"] == N_TEST
    local = [r["local_total"] for r in ranks]
    assert sum(local) == N_TEST
    assert local == [math.ceil(N_TEST / world)] * (N_TEST % world or world) + [N_TEST // world] * (
        world - (N_TEST % world or world)
    )


def test_summarize_per_class_accuracy():
    confusion = torch.tensor([[3, 1, 0], [0, 0, 0], [2, 0, 4]])
    result = summarize(confusion)
    assert result["correct"] == 7 and result["samples_evaluated"] == 10
    assert result["accuracy"] == 0.7
    assert result["per_class_accuracy"] == [0.75, None, 4 / 6]  # class 1 has no samples


def test_empty_shard_is_fine_in_a_single_process():
    # more ranks than samples leaves some shards empty; counting an empty shard gives zeros
    model = small_cnn(1, 4, 3).eval()
    norm = (torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))
    empty = torch.zeros(0, 1, 8, 8, dtype=torch.uint8)
    counts, loss = shard_counts(model, empty, torch.zeros(0, dtype=torch.int64), 3, 4, norm)
    assert counts.shape == (3, 3) and int(counts.sum()) == 0 and float(loss) == 0.0
