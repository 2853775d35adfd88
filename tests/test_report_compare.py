"""The report ranks only runs that compare (ddpflow.report.compare): the same task, selection
metric, data and, for language models, vocabulary. Runs that differ are not ranked, not
starred, and the headline says why; runs that compare are selected on validation, never on
the test figure. Real files in results/runs/<run>/ in the formats the jobs write, built in
tmp_path: no training."""

from __future__ import annotations

import json
import math
import re

import pytest
from ddpflow import pipeline
from ddpflow.report.compare import identity
from test_report import _epoch
from test_report_tasks import _selection, _task_eval, regression_eval, write_run


def _data(source: str, **keys) -> dict:
    return {"source": source, "seed": 0, "val_fraction": 0.1, "test_fraction": 0.2, **keys}


def _config(ev: dict, data: dict, task: str) -> dict:
    """The run's resolved config as provenance records it: its data section above all."""
    ev["provenance"]["config"] = {"data": data, "model": {"name": "m"}, "task": task}
    return ev


def lm_eval(name: str, perplexity: float, data: dict, vocab: int) -> dict:
    """A language model's record (ddpflow.task.lm), with train_summary's language_model."""
    ev = {
        **_task_eval(name, 50.0),
        "task": "language_model",
        "selection": _selection("val_perplexity", False, "validation perplexity"),
        "headline": ["perplexity", "loss", "token_accuracy"],
        "class_names": [],
        "perplexity": perplexity,
        "loss": math.log(perplexity),
        "token_accuracy": 0.3,
        "tokens": 6400,
    }
    ev["train"].update(data_in_memory=False)
    ev["train"]["language_model"] = {
        "block_size": 64, "vocab_size": vocab, "tokens_trained": 640_000,
        "tokens": {"train": 50_000, "val": 6_400, "test": 6_400}, "tokens_per_s": 3_200.0,
    }  # fmt: skip
    return _config(ev, data, "language_model")


def lm_epochs(name: str, perplexity: float) -> list[dict]:
    records = []
    for e in range(3):
        record = _epoch(name, 1, e, 2.0 - 0.4 * e, 50.0)
        del record["val_accuracy"]
        records.append(
            {**record, "val_perplexity": perplexity * (3 - e), "val_token_accuracy": 0.1 * e}
        )
    return records


def _report(results, evals: dict, epochs: dict | None = None) -> dict:
    for name, ev in evals.items():
        write_run(results, name, ev, epochs=(epochs or {}).get(name))
    return pipeline.build_report(str(results), list(evals), [None] * len(evals))


def _starred(paths: dict) -> list[str]:
    page = paths["html"].read_text()
    runs_table = page.split("<h2>Runs</h2>")[1].split("</table>")[0]
    return re.findall(r"<tr class='best'><td>(.*?)</td>", runs_table)


def test_language_models_of_different_tokenizers_are_not_ranked(tmp_path):
    """A byte model (vocabulary 257) reads a far lower perplexity than a 1000-token model:
    neither is 'best', and the headline says they use different tokenizers. The machine
    table counts tokens/s and says the tokens are memory-mapped."""
    byte = lm_eval("byte", 3.0, _data("text", path="corpus.txt", vocab_size=None), 257)
    bpe = lm_eval("bpe", 40.0, _data("tokens", path="tok/", vocab_size=1000), 1000)
    epochs = {"byte": lm_epochs("byte", 3.0), "bpe": lm_epochs("bpe", 40.0)}
    paths = _report(tmp_path / "results", {"byte": byte, "bpe": bpe}, epochs)
    markdown = paths["markdown"].read_text()
    assert (
        "2 runs; not compared: byte (byte vocabulary 257) and bpe (vocabulary 1,000) use "
        "different tokenizers: perplexity compares only under the same tokenizer"
    ) in markdown
    assert "best" not in markdown.split("\n## ")[0] and "★" not in markdown
    assert _starred(paths) == []
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["best_run"] is None and summary["best_by_task"] == {}
    assert [(g["runs"], g["vocabulary"], g["best"]) for g in summary["groups"]] == [
        (["byte"], 257, None),
        (["bpe"], 1000, None),
    ]
    assert [row["group"] for row in summary["runs"]] == [1, 2]
    machine = markdown.split("## Machine and speed")[1].split("\n## ")[0]
    assert "Train tokens/s" in machine and "| 3,200 |" in machine
    assert "tokens memory-mapped" in machine
    assert "samples/s" not in machine and "data streamed" not in machine
    assert summary["runs"][0]["train_tokens_per_s"] == 3200.0


def test_regressions_on_different_data_are_not_ranked(tmp_path):
    """Two regressions on two npz files: their MSEs are in different units of different
    targets; the headline names what differs instead of ranking them."""
    evals = {
        "house": _config(
            regression_eval("house", 0.2), _data("npz", path="house.npz"), "regression"
        ),
        "bike": _config(regression_eval("bike", 0.5), _data("npz", path="bike.npz"), "regression"),
    }
    paths = _report(tmp_path / "results", evals)
    markdown = paths["markdown"].read_text()
    assert (
        "2 runs; not compared: house (data.path house.npz) and bike (data.path bike.npz) "
        "were validated and tested on different data."
    ) in markdown
    assert _starred(paths) == [] and "★" not in markdown
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["best_run"] is None
    assert [row["best"] for row in summary["runs"]] == [False, False]
    assert "group" in paths["summary_csv"].read_text().splitlines()[0].split(",")


def test_runs_on_the_same_data_are_selected_on_validation_not_test(tmp_path):
    """Same data (a different image size and training cap still compare): b has the lower
    validation MSE, a the lower test MSE; b is selected and the headline says on what."""
    same = _data("npz", path="house.npz")
    a = _config(regression_eval("a", 0.1), {**same, "image_size": 32}, "regression")
    b = _config(regression_eval("b", 0.4), {**same, "max_train_samples": 50}, "regression")
    epochs = {
        name: [
            {**_epoch(name, 1, e, 1.0, 900.0), "val_mse": val, "val_mae": val, "val_r2": 0.5}
            for e in range(2)
        ]
        for name, val in (("a", 0.9), ("b", 0.3))
    }
    paths = _report(tmp_path / "results", {"a": a, "b": b}, epochs)
    markdown = paths["markdown"].read_text()
    assert "2 runs; selected on validation MSE (lower is better) among runs a, b: b." in markdown
    assert "best test" not in markdown and "not compared" not in markdown
    assert _starred(paths) == ["b ★ best"]
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["best_run"] == "b" and summary["best_by_task"] == {"regression": "b"}
    assert summary["groups"] == [
        {"group": 1, "task": "regression", "selected_by": "val_mse", "higher_is_better": False,
         "runs": ["a", "b"], "best": "b"},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "vocab"),
    [(_data("text", path="c.txt"), 257), (_data("tokens", path="t/", vocab_size=50257), 50257)],
)
def test_a_language_models_vocabulary_without_its_train_record(data, vocab):
    """A record whose train summary lacks the language_model block: the config says it."""
    ev = lm_eval("x", 3.0, data, vocab)
    del ev["train"]["language_model"]
    assert identity(ev).vocabulary == vocab


def _tied(name: str, loss: float, rate: float) -> list[dict]:
    """Epochs whose final validation MSE is 0.3 (a tie), with this validation loss."""
    return [
        {**_epoch(name, 1, e, 1.0, rate), "val_mse": 0.3, "val_mae": 0.3, "val_r2": 0.5,
         "val_loss": loss}
        for e in range(2)
    ]  # fmt: skip


def test_a_tie_goes_to_the_lower_validation_loss_never_to_the_faster_run(tmp_path):
    """a and b tie on validation MSE; a is much faster, b has the lower validation loss: b is
    selected, and the headline says the metric tied and what decided."""
    same = _data("npz", path="house.npz")
    evals = {n: _config(regression_eval(n, 0.2), same, "regression") for n in ("a", "b")}
    epochs = {"a": _tied("a", 0.5, 9000.0), "b": _tied("b", 0.4, 90.0)}
    paths = _report(tmp_path / "results", evals, epochs)
    markdown = paths["markdown"].read_text()
    assert "among runs a, b: b (tied on validation MSE 0.3000; the lower validation loss, " in (
        markdown
    )
    assert _starred(paths) == ["b ★ best"]


def test_runs_equal_on_metric_and_loss_are_a_tie_with_no_star(tmp_path):
    same = _data("npz", path="house.npz")
    evals = {n: _config(regression_eval(n, 0.2), same, "regression") for n in ("a", "b")}
    epochs = {"a": _tied("a", 0.4, 9000.0), "b": _tied("b", 0.4, 90.0)}
    paths = _report(tmp_path / "results", evals, epochs)
    markdown = paths["markdown"].read_text()
    assert "a, b tie on validation MSE (0.3000) and validation loss: no run selected" in markdown
    assert _starred(paths) == []
    assert json.loads(paths["summary_json"].read_text())["best_run"] is None


def test_the_data_words_name_each_split_by_its_own_size():
    """digits: val 144, test 359; the identity's JSON sorts test before val."""
    from ddpflow.report.compare import _data_value

    assert _data_value("sizes", {"test": 359, "val": 144}) == "samples val/test 144/359"
