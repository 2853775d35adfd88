"""A language model through the whole workflow, as a user runs it: a folder of text files
(Python's own json package) staged as bytes, gpt trained at 2 ranks and at 1 (the same
test perplexity and token count), the report's language-model section with its samples,
the edit-and-rerun loop on the new keys, and a block_size longer than a split refused
before any rank starts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from workflow_helpers import jobs_planned, snakemake, write_config

pytestmark = pytest.mark.e2e

JSON = Path(json.__file__).parent


def _config(**data) -> dict:
    return {
        "task": "language_model",
        "data": {"source": "text", "path": "corpus", "block_size": 64, **data},
        "model": {"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 4, "n_embd": 64}},
        "eval": {"batch_size": "auto"},  # chosen to fit each run's ranks
        "train": {"epochs": 3, "global_batch_size": 32, "micro_batch_size": 16,
                  "optimizer": {"name": "adamw", "lr": 0.003, "weight_decay": 0.1}},
        # torch_export applies to image runs; a language model's export is safetensors
        "export": {"formats": ["safetensors", "torch_export"]},
        "runs": [{"name": "two", "machine": {"cpu_ranks_per_node": 2}},
                 {"name": "one", "machine": {"cpu_ranks_per_node": 1}}],
    }  # fmt: skip


def _corpus(workdir: Path) -> None:
    shutil.copytree(JSON, workdir / "corpus", ignore=shutil.ignore_patterns("__pycache__"))


def test_a_text_folder_trains_gpt_at_2_ranks_and_1_to_the_same_perplexity(workdir):
    _corpus(workdir)
    config = write_config(workdir / "config.yaml", _config())
    done = snakemake(workdir, config)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    scored = {}
    for run in ("two", "one"):
        record = json.loads((workdir / f"results/runs/{run}/eval_metrics.json").read_text())
        assert record["task"] == "language_model" and record["split"] == "test"
        scored[run] = record
    two, one = scored["two"], scored["one"]
    assert two["world_size"] == 2 and one["world_size"] == 1
    staged = next((workdir / "results/staged").glob("text-*"))
    tokens = json.loads((staged / "manifest.json").read_text())["tokens"]
    assert two["tokens"] == one["tokens"] == tokens["test"] - 1  # every position scored once
    assert one["perplexity"] == pytest.approx(two["perplexity"], rel=1e-4)
    assert two["perplexity"] < 256 / 4  # far below the byte-level baseline
    assert "tokens/s on 2 ranks" in output and "val perplexity" in output

    summary = json.loads((workdir / "results/runs/two/train_summary.json").read_text())
    # eval.batch_size auto: the parse and the train rule said what it chose; the ranks
    # evaluated at the batch the train rule wrote for them
    chosen = json.loads((workdir / "results/work/two/admitted.json").read_text())["eval_batch"]
    assert f"evaluation at eval.batch_size auto: {chosen}" in output, output[-3000:]
    # the FLOPs counted on fake tensors agree with the gpt's 6N + 12LHQT formula (issue 57)
    efficiency = summary["efficiency"]
    assert efficiency["counted"] and efficiency["model_tflops"] > 0
    assert efficiency["formula_flops_per_step"] == pytest.approx(
        efficiency["model_flops_per_step"], rel=0.05
    )
    lm = summary["language_model"]
    assert lm["block_size"] == 64 and lm["vocab_size"] == 257 and lm["tokens"] == tokens
    samples = lm["generated"]["samples"]
    assert len(samples) == 3 and all(len(s["text"]) > 0 for s in samples)
    report = (workdir / "results/report/report.md").read_text()
    assert "## Language models" in report and "### Samples from two" in report
    assert "Test perplexity" in report
    assert (workdir / "results/report/plots/val_perplexity.png").is_file()
    meta = (workdir / "results/runs/two/model.safetensors").read_bytes()[:4096]
    assert b'"tied"' in meta  # the output layer is the token embedding
    assert not (workdir / "results/runs/two/model.pt2").exists()

    _the_docs_sampling_example_runs(workdir, run="two")

    # edit and rerun: the context length restages and retrains; the model only retrains
    longer = write_config(workdir / "config.yaml", _config(block_size=32))
    assert {"stage", "train", "evaluate"} <= jobs_planned(workdir, longer)
    deeper = _config()
    deeper["model"]["kwargs"]["n_layer"] = 3
    planned = jobs_planned(workdir, write_config(workdir / "config.yaml", deeper))
    assert "train" in planned and "stage" not in planned
    assert jobs_planned(workdir, write_config(workdir / "config.yaml", _config())) == set()
    _the_window_keys_rerun_what_they_change(workdir)
    _generations_at_2_ranks_and_1(workdir)


def _the_window_keys_rerun_what_they_change(workdir: Path) -> None:
    """eval.stride at block_size and train.fresh_windows: false are what the finished runs
    did: nothing to do. A smaller stride re-evaluates only; fresh windows retrain only."""

    def planned(section: str, **keys) -> set:
        config = _config()
        config[section] = {**config.get(section, {}), **keys}
        return jobs_planned(workdir, write_config(workdir / "config.yaml", config))

    assert planned("eval", stride=64) | planned("train", fresh_windows=False) == set()
    strided = planned("eval", stride=16)
    assert "evaluate" in strided and not {"stage", "train"} & strided
    fresh = planned("train", fresh_windows=True)
    assert "train" in fresh and "stage" not in fresh
    write_config(workdir / "config.yaml", _config())


def _the_docs_sampling_example_runs(workdir: Path, run: str) -> None:
    """docs/language-models.md's sampling example, as written but for the run's name: a
    clean run that continues the prompt, the same text twice (seeded)."""
    page = (Path(__file__).parents[1] / "docs/language-models.md").read_text()
    example = re.search(r"## Sample from a trained model.*?```python\n(.*?)```", page, re.S)
    code = example.group(1).replace('RUN = "tiny-gpt"', f'RUN = "{run}"')
    assert f'RUN = "{run}"' in code
    outputs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr[-3000:]
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1] and outputs[0].startswith("def load(")
    assert len(outputs[0]) > len("def load(") + 50


PROMPTS = ["def load(", "import json", "x" * 80, "ünïcode"]  # "x" * 80: longer than a block
GENERATE = {"prompts": "prompts.txt", "max_new_tokens": 24, "top_k": 20, "runs": ["two"]}


def _generate(workdir: Path, config: dict, *args: str):
    """`snakemake generate` (the target after an option: --configfile takes every word)."""
    configfile = write_config(workdir / "generate.yaml", config)
    return snakemake(workdir, configfile, "--cores", "2", "generate", *args)


def _generations_at_2_ranks_and_1(workdir: Path) -> None:
    """`snakemake generate` on run two's model at its 2 ranks, then at 1 (a machine edit,
    which plans nothing): the same generations.jsonl byte for byte, a line per prompt in
    order. The generate section is in no run's fingerprint; editing it generates again;
    an unset prompts file is refused before any job."""
    (workdir / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    config = {**_config(), "generate": GENERATE}
    assert jobs_planned(workdir, write_config(workdir / "config.yaml", config)) == set()
    done = _generate(workdir, config)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "generate 'two': 4 prompts, 96 new tokens on 2 ranks" in output
    assert "line 3 is longer than data.block_size (64 tokens)" in output
    generated = workdir / "results/runs/two/generations.jsonl"
    lines = [json.loads(line) for line in generated.read_text().splitlines()]
    assert [line["prompt"] for line in lines] == PROMPTS
    assert [line["cropped"] for line in lines] == [0, 0, 80 - 64, 0]
    assert all(len(line["tokens"]) == 24 and line["completion"] for line in lines)
    assert len({line["seed"] for line in lines}) == 4
    at_two = generated.read_bytes()

    one = _config()
    one["runs"][0]["machine"] = {"cpu_ranks_per_node": 1}
    at_one = {**one, "generate": GENERATE}
    assert (
        jobs_planned(workdir, write_config(workdir / "generate.yaml", at_one), "generate") == set()
    )
    done = _generate(workdir, at_one, "--forcerun", "generate_run")
    assert done.returncode == 0 and "on 1 rank" in done.stderr, done.stderr[-4000:]
    assert generated.read_bytes() == at_two

    hotter = {**config, "generate": {**GENERATE, "temperature": 1.5}}
    planned = jobs_planned(workdir, write_config(workdir / "generate.yaml", hotter), "generate")
    assert planned == {"generate_run", "generate"}
    unset = _generate(workdir, {**config, "generate": {"runs": ["two"]}}, "-n")
    assert unset.returncode != 0 and "generate.prompts is not set" in unset.stderr
    assert "localrule generate_run" not in unset.stdout + unset.stderr  # no job


def test_a_block_size_longer_than_a_split_is_refused_before_any_rank_starts(workdir):
    (workdir / "corpus").mkdir()
    shutil.copy(JSON / "tool.py", workdir / "corpus" / "tool.py")  # 3,339 bytes
    config = write_config(workdir / "config.yaml", _config(block_size=1024))
    done = snakemake(workdir, config)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "data.block_size 1024: the val split has 334 tokens" in output
    assert not (workdir / "logs/submitit").exists() and not (workdir / "results/runs").exists()
