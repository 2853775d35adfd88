"""Unit tests of the report stage, on fake per-run metrics written in tmp_path."""

from __future__ import annotations

import base64
import csv
import io
import json
import re

import matplotlib.image
import pytest
from ddpflow.report.build import FOCUS_RUNS, MANY_RUNS, build_report, load_train_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CLASSES = ["cat", "dog", "<bird>"]
# rows = true class; trace 91 of 100 -> accuracy 0.91
CONFUSION = [[30, 2, 1], [3, 28, 2], [0, 1, 33]]


def _epoch(run: str, attempt: int, epoch: int, loss: float, rate: float) -> dict:
    return {
        "run": run, "attempt": attempt, "epoch": epoch, "step": 10 * (epoch + 1),
        "train_loss": loss, "val_accuracy": 1.0 - loss / 4, "val_loss": loss * 1.1,
        "lr": 0.01, "samples_per_s": rate,
        "seconds": {"data": 0.5, "forward": 1.0, "backward_sync": 2.0, "optimizer": 0.25,
                    "epoch": 4.0},
    }  # fmt: skip


def _eval(run: str, world: int, nodes: int, rate: float, attempts: int) -> dict:
    hosts = [f"node{i}" for i in range(nodes)]
    return {
        "run": run, "accuracy": 0.91, "per_class_accuracy": [30 / 33, 28 / 33, 33 / 34],
        "confusion_matrix": CONFUSION, "class_names": CLASSES, "samples_evaluated": 100,
        "test_size": 100, "world_size": world, "hosts": hosts, "eval_seconds": 1.5,
        "train": {"world_size": world, "nodes": nodes, "samples_per_s": rate,
                  "wall_seconds": 300.0 / world, "epochs": 4, "attempts": attempts,
                  "hosts": hosts, "phase_seconds": {"data": 2.0, "forward": 4.0}},
        "provenance": {"config": {"model": "cnn", "epochs": 4, "note": "a ``` b"},
                       "git_commit": "abc1234", "versions": {"torch": "2.14.1"},
                       "hostnames": hosts, "created": "2025-01-01T00:00:00+00:00"},
    }  # fmt: skip


def _write_run(root, name, world, nodes, rate, resumed=False, accuracy=0.91) -> dict:
    """Write one run's train/eval metrics; resumed: attempt 2 re-did epoch 2."""
    run_dir = root / f"run{world}"
    run_dir.mkdir(parents=True)
    if resumed:
        records = [_epoch(name, 1, e, 2.0 - 0.4 * e, rate) for e in range(3)]
        records += [_epoch(name, 2, e, 1.0 - 0.2 * e, rate) for e in (2, 3)]
    else:
        records = [_epoch(name, 1, e, 2.0 - 0.4 * e, rate) for e in range(4)]
    train = run_dir / "train_metrics.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    ev = _eval(name, world, nodes, rate, attempts=2 if resumed else 1)
    ev["accuracy"] = accuracy
    evaluation = run_dir / "eval_metrics.json"
    evaluation.write_text(json.dumps(ev))
    return {"name": name, "train_metrics": train, "eval_metrics": evaluation}


def _three_runs(root) -> list[dict]:
    return [
        _write_run(root, "r1", 1, 1, 1000.0),
        _write_run(root, "<b>x", 2, 1, 1900.0, resumed=True, accuracy=0.95),
        _write_run(root, "r4", 4, 2, 3600.0),
    ]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    runs = _three_runs(root / "runs")
    return runs, build_report(runs, root / "out"), root / "out"


def test_writes_all_files_and_real_pngs(report):
    _, paths, out = report
    for name in ("report.md", "report.html", "summary.json", "summary.csv"):
        assert (out / name).is_file()
    stems = {p.stem for p in (out / "plots").glob("*.png")}
    assert {
        "loss",
        "val_accuracy",
        "throughput",
        "scaling",
        "confusion_r1",
        "confusion_r4",
    } <= stems
    assert any(s.startswith("confusion__b_x") for s in stems)  # sanitised, hash-suffixed
    assert {p.stem for p in paths.values() if p.suffix == ".png"} == stems
    for png in (out / "plots").glob("*.png"):
        assert png.read_bytes()[:8] == PNG_SIGNATURE
        image = matplotlib.image.imread(png)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert not list(out.rglob("*.tmp"))  # atomic writes leave no temp files


def test_html_is_self_contained_and_escaped(report):
    _, _, out = report
    page = (out / "report.html").read_text()
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(images) == len(list((out / "plots").glob("*.png")))
    assert base64.b64decode(images[0])[:8] == PNG_SIGNATURE
    assert "<b>x" not in page and "&lt;b&gt;x" in page
    assert "&lt;bird&gt;" in page and "<bird>" not in page
    assert "<style>" in page and "plots/" not in page  # nothing fetched from outside
    best_row = re.search(r"<tr class='best'>(.*?)</tr>", page).group(1)
    assert "&lt;b&gt;x ★ best" in best_row
    assert "<details><summary>Resolved config (YAML)</summary><pre>" in page
    assert "git commit: abc1234" in page and "2.14.1" in page


def test_markdown_escapes_and_links_plots(report):
    _, _, out = report
    text = (out / "report.md").read_text()
    assert text.startswith("# ddpflow report")
    assert "<b>x" not in text and "&lt;b&gt;x" in text
    assert "](plots/scaling.png)" in text and "](plots/loss.png)" in text
    assert "````yaml" in text  # the config holds ``` so the fence must be longer


def test_summary_numbers_equal_inputs(report):
    runs, _, out = report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_run"] == "<b>x"
    for run, row in zip(runs, summary["runs"], strict=True):
        ev = json.loads(run["eval_metrics"].read_text())
        assert row["run"] == run["name"]
        assert row["accuracy"] == ev["accuracy"]
        assert row["world_size"] == ev["train"]["world_size"]
        assert row["nodes"] == ev["train"]["nodes"]
        assert row["train_samples_per_s"] == ev["train"]["samples_per_s"]
        assert row["train_wall_seconds"] == ev["train"]["wall_seconds"]
        assert row["attempts"] == ev["train"]["attempts"]
        assert row["samples_evaluated"] == 100 and row["test_size"] == 100
        assert row["forward_seconds"] == 4 * 1.0  # four kept epochs, duplicate dropped
        assert summary["provenance"][run["name"]] == ev["provenance"]
    assert summary["per_class_accuracy"]["r1"]["<bird>"] == 33 / 34
    with open(out / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["run"] for r in rows] == ["r1", "<b>x", "r4"]
    assert float(rows[2]["train_samples_per_s"]) == 3600.0 and rows[2]["hosts"] == "node0 node1"


def test_speedup_and_efficiency(report):
    _, _, out = report
    summary = json.loads((out / "summary.json").read_text())
    by_run = {row["run"]: row for row in summary["runs"]}
    assert summary["scaling_baseline"] == {
        "world_size": 1,
        "samples_per_s": 1000.0,
        "runs": ["r1", "<b>x", "r4"],
    }
    assert by_run["r1"]["speedup"] == pytest.approx(1.0)
    assert by_run["<b>x"]["speedup"] == pytest.approx(1.9)
    assert by_run["<b>x"]["efficiency"] == pytest.approx(0.95)
    assert by_run["r4"]["speedup"] == pytest.approx(3.6)
    assert by_run["r4"]["efficiency"] == pytest.approx(0.9)
    assert "95.0%" in (out / "report.html").read_text()


def test_resumed_run_keeps_last_epoch(report):
    runs, _, out = report
    epochs = load_train_metrics("<b>x", runs[1]["train_metrics"])
    assert [e["epoch"] for e in epochs] == [0, 1, 2, 3]
    assert epochs[2]["attempt"] == 2 and epochs[2]["train_loss"] == pytest.approx(0.6)  # not 1.2
    row = json.loads((out / "summary.json").read_text())["runs"][1]
    assert row["final_train_loss"] == pytest.approx(0.4)


def test_no_scaling_with_one_world_size(tmp_path):
    out = tmp_path / "out"
    (out / "plots").mkdir(parents=True)
    (out / "plots" / "scaling.png").write_bytes(PNG_SIGNATURE)  # left by an earlier report
    runs = [
        _write_run(tmp_path / "a", "a", 2, 1, 900.0),
        _write_run(tmp_path / "b", "b", 2, 1, 950.0),
    ]
    paths = build_report(runs, out)
    assert "plot_scaling" not in paths and not (out / "plots" / "scaling.png").exists()
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["scaling_baseline"] is None
    assert all(row["speedup"] is None for row in summary["runs"])
    assert "Speedup" not in paths["html"].read_text()


def _with_config(run: dict, model: str, world: int) -> dict:
    """A run whose provenance holds a real-looking config: its model and machine shape."""
    path = run["eval_metrics"]
    ev = json.loads(path.read_text())
    ev["provenance"]["config"] = {
        "data": {"source": "digits"},
        "model": {"name": model},
        "train": {"epochs": 4, "global_batch_size": 64, "micro_batch_size": 32, "progress": False},
        "machine": {"gpus_per_node": 0, "cpu_ranks_per_node": world},
    }
    ev["train"].update(parameters=1234, lr=0.05, global_batch=64, precision="fp32")
    path.write_text(json.dumps(ev))
    return run


def test_scaling_compares_only_runs_that_differ_in_machine_shape(tmp_path):
    """A cnn at 1, 2 and 4 ranks, an mlp and a resnet18 at other sizes: the cnn alone is a
    scaling study; the mlp and resnet18 get no speedup (not 'Speedup 0.19x' against a cnn)."""
    runs = [
        _with_config(_write_run(tmp_path / "a", "cnn1", 1, 1, 1000.0), "cnn", 1),
        _with_config(_write_run(tmp_path / "b", "cnn2", 2, 1, 1800.0), "cnn", 2),
        _with_config(_write_run(tmp_path / "c", "cnn4", 4, 1, 3000.0), "cnn", 4),
        _with_config(_write_run(tmp_path / "d", "mlp", 8, 2, 9000.0), "mlp", 8),
        _with_config(_write_run(tmp_path / "e", "resnet", 16, 4, 190.0), "resnet18", 16),
    ]
    paths = build_report(runs, tmp_path / "out")
    summary = json.loads(paths["summary_json"].read_text())
    rows = {row["run"]: row for row in summary["runs"]}
    assert summary["scaling_baseline"]["runs"] == ["cnn1", "cnn2", "cnn4"]
    assert rows["cnn4"]["speedup"] == pytest.approx(3.0)
    assert rows["cnn2"]["efficiency"] == pytest.approx(0.9)
    assert rows["mlp"]["speedup"] is None and rows["resnet"]["speedup"] is None
    page = paths["html"].read_text()
    assert "Throughput against ranks (cnn1, cnn2, cnn4)" in page
    assert "0.19×" not in page and "3.00×" in page
    # the runs table says what each run trained
    assert "<td>resnet18</td>" in page and "<td>1,234</td>" in page and "<td>64</td>" in page
    assert "node0 ×" not in page  # one rank per host here; hosts are listed once each


def test_hosts_are_listed_once_with_their_rank_count():
    from ddpflow.report.tables import hosts_text as _hosts

    assert _hosts(["vm"] * 4) == "vm ×4"
    assert _hosts(["n1", "n1", "n2", "n2"]) == "n1 ×2, n2 ×2"
    assert _hosts([f"n{i}" for i in range(6)]) == "n0, n1, n2, n3, … (+2 hosts)"
    assert _hosts([f"n{i}" for i in range(5)]) == "n0, n1, n2, n3, … (+1 host)"


def _unfinished(paths) -> dict[str, str]:
    return {
        u["run"]: u["cause"] for u in json.loads(paths["summary_json"].read_text())["unfinished"]
    }


def test_a_missing_file_is_named_and_the_others_are_reported(tmp_path):
    """The report is the most robust rule: a run it cannot read is listed with the reason
    (run and file named), the other runs are reported as usual."""
    runs = _three_runs(tmp_path)
    runs[2]["eval_metrics"].unlink()
    paths = build_report(runs, tmp_path / "out")
    summary = json.loads(paths["summary_json"].read_text())
    assert [row["run"] for row in summary["runs"]] == ["r1", "<b>x"]
    assert re.search(r"run 'r4': eval_metrics .*eval_metrics\.json", _unfinished(paths)["r4"])
    assert "Runs that did not finish" in paths["markdown"].read_text()


def test_a_missing_key_a_cut_line_and_a_none_are_named(tmp_path):
    runs = _three_runs(tmp_path)
    ev = json.loads(runs[0]["eval_metrics"].read_text())
    del ev["train"]["wall_seconds"]
    runs[0]["eval_metrics"].write_text(json.dumps(ev))
    with open(runs[1]["train_metrics"], "a") as handle:
        handle.write('{"run": "<b>x", "ep\n')  # a line cut short by a killed writer
    ev = json.loads(runs[2]["eval_metrics"].read_text())
    ev["accuracy"] = None
    runs[2]["eval_metrics"].write_text(json.dumps(ev))
    paths = build_report(runs, tmp_path / "out")
    causes = _unfinished(paths)
    assert "'train.wall_seconds'" in causes["r1"]
    assert "line 6 is not JSON" in causes["<b>x"]
    assert "'accuracy' has type NoneType" in causes["r4"]
    assert json.loads(paths["summary_json"].read_text())["runs"] == []
    assert paths["html"].stat().st_size > 0


def test_an_emptied_history_is_named_in_a_rebuilt_report(tmp_path):
    runs = _three_runs(tmp_path)
    build_report(runs[:2], tmp_path / "out")
    runs[2]["train_metrics"].write_text("")
    paths = build_report(runs, tmp_path / "out")
    assert "no epochs recorded" in _unfinished(paths)["r4"]
    assert len(json.loads(paths["summary_json"].read_text())["runs"]) == 2


def test_a_class_without_a_test_sample_is_shown_as_na(tmp_path):
    """A class the evaluated split has no sample of (a stratified split of a one-image class,
    an npz whose test split lacks it): zero support, n/a, and the report is written."""
    runs = _three_runs(tmp_path)
    ev = json.loads(runs[0]["eval_metrics"].read_text())
    ev["confusion_matrix"] = [[30, 2, 1], [3, 28, 2], [0, 0, 0]]
    ev["per_class_accuracy"] = [30 / 33, 28 / 33, None]
    runs[0]["eval_metrics"].write_text(json.dumps(ev))
    paths = build_report(runs, tmp_path / "out")
    markdown = paths["markdown"].read_text()
    assert "| &lt;bird&gt; | n/a (0 samples) | 97.06% (34) | 97.06% (34) |" in markdown
    assert "90.91% (33)" in markdown
    assert "<td>&lt;bird&gt;</td><td>n/a (0 samples)</td>" in paths["html"].read_text()
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["per_class_accuracy"]["r1"]["<bird>"] is None
    assert not summary["unfinished"] and len(summary["runs"]) == 3
    assert [r["run"] for r in csv.DictReader(paths["summary_csv"].open())] == ["r1", "<b>x", "r4"]
    # the confusion matrix has an empty row: drawn, not divided by zero
    image = matplotlib.image.imread(paths["plot_confusion_r1"])
    assert image.ndim == 3 and image.shape[0] > 100


def test_short_times_read_as_measured():
    from ddpflow.report.render import _seconds

    assert _seconds(0.042) == "42 ms" and _seconds(1.5) == "1.5 s" and _seconds(600) == "10.0 min"


def test_a_validation_split_is_labelled_validation_not_test(tmp_path):
    run = _write_run(tmp_path / "v", "v", 2, 1, 900.0)
    ev = json.loads(run["eval_metrics"].read_text())
    ev["split"] = "val"
    ev["provenance"]["git_dirty"] = True
    run["eval_metrics"].write_text(json.dumps(ev))
    page = build_report([run], tmp_path / "out")["html"].read_text()
    assert "Validation accuracy" in page and "Evaluated / validation size" in page
    assert "Per-class validation accuracy" in page and "1 run; nothing to compare it with." in page
    assert "Test accuracy" not in page and "test accuracy" not in page
    assert "git commit: abc1234 with uncommitted changes" in page


def test_epoch_plots_include_validation_loss_lr_and_throughput(report):
    _, paths, _ = report
    for stem in ("loss", "val_loss", "val_accuracy", "lr", "throughput_epochs", "throughput"):
        image = matplotlib.image.imread(paths[f"plot_{stem}"])
        assert image.ndim == 3 and image.shape[0] > 100, stem


def test_loss_spanning_decades_gets_a_log_axis():
    from ddpflow.report.plots import per_epoch_figure

    wide = {"a": [(1, 2.3), (2, 0.4), (3, 0.02)]}
    narrow = {"a": [(1, 2.3), (2, 1.4), (3, 0.9)]}
    assert per_epoch_figure(wide, "loss", "t", log_if_wide=True).axes[0].get_yscale() == "log"
    assert per_epoch_figure(narrow, "loss", "t", log_if_wide=True).axes[0].get_yscale() == "linear"
    # NaN (a diverged epoch kept with train.on_nonfinite: warn) does not break the decision
    nan = {"a": [(1, 2.3), (2, float("nan")), (3, 0.01)]}
    assert per_epoch_figure(nan, "loss", "t", log_if_wide=True).axes[0].get_yscale() == "log"
    assert per_epoch_figure(wide, "acc", "t").axes[0].get_yscale() == "linear"


def test_throughput_of_one_run_is_one_labelled_bar():
    from ddpflow.report.plots import plot_throughput

    one = matplotlib.image.imread(io.BytesIO(plot_throughput(["cnn"], [5017.0])))
    many = plot_throughput([f"r{i}" for i in range(8)], [1000.0 * (i + 1) for i in range(8)])
    many = matplotlib.image.imread(io.BytesIO(many))
    assert one.shape[1] == many.shape[1] and one.shape[0] < many.shape[0] / 2


def test_a_run_continued_at_another_world_size_lists_its_segments(tmp_path):
    """A run that trained its first 24 steps on 4 ranks (node0, node1) and its last 16 on 2
    (node0 alone): the report's segment table says where each stretch ran; a run in one piece
    adds no table."""
    moved = _write_run(tmp_path / "a", "moved", 2, 1, 900.0, resumed=True)
    ev = json.loads(moved["eval_metrics"].read_text())
    ev["train"]["segments"] = [
        {"world_size": 4, "hosts": ["node0", "node0", "node1", "node1"], "attempt": 1,
         "start_step": 0, "end_step": 24},
        {"world_size": 2, "hosts": ["node0", "node0"], "attempt": 2, "start_step": 24,
         "end_step": 40},
    ]  # fmt: skip
    moved["eval_metrics"].write_text(json.dumps(ev))
    still = _write_run(tmp_path / "b", "still", 2, 1, 950.0)
    markdown = build_report([moved, still], tmp_path / "out")["markdown"].read_text()
    assert "Segments: runs continued on another allocation" in markdown
    rows = [line for line in markdown.splitlines() if line.startswith("| moved |")]
    assert any("| 1 | 4 | node0 ×2, node1 ×2 | 0–24 | 24 | 1 |" in r for r in rows), rows
    assert any("| 2 | 2 | node0 ×2 | 24–40 | 16 | 2 |" in r for r in rows), rows
    one_piece = build_report([still], tmp_path / "out1")["markdown"].read_text()
    assert "Segments" not in one_piece


def test_the_provenance_says_what_staging_upscaled_or_skipped():
    """An image folder's line names corrupt, ignored and small images; a plug-in's has only
    the small ones; a manifest staged before data.on_small existed has none of its keys."""
    from ddpflow.report.tables import dataset_line

    folder = {"skipped_corrupt": 1, "skipped_files": ["x.png"], "ignored_files": 2}
    small = {"on_small": "upscale", "image_size": [32, 48], "upscaled_small": 12,
             "skipped_small": 0, "small_per_split": {"train": 12}, "small_files": []}  # fmt: skip
    lines = {
        name: dataset_line({"source": "s", "sizes": {"train": 5}, "source_notes": notes})[0][1]
        for name, notes in (("old", folder), ("folder", {**folder, **small}), ("plugin", small))
    }
    assert lines["old"] == (
        "data: s (train 5); 1 corrupt image skipped, 2 files that are not images ignored"
    )
    one = dataset_line({"source": "s", "sizes": {}, "source_notes": {**folder, "ignored_files": 1}})
    assert "1 file that is not an image ignored" in one[0][1]
    assert lines["folder"] == lines["old"] + (
        "; 12 images smaller than data.image_size [32, 48] upscaled (data.on_small: upscale)"
    )
    assert lines["plugin"] == "data: s (train 5); 12 images smaller than data.image_size " + (
        "[32, 48] upscaled (data.on_small: upscale)"
    )


def _edit(path, change) -> None:
    """Rewrite a run's eval_metrics.json (a dict) or train_metrics.jsonl (each epoch) in place."""
    if path.suffix == ".json":
        record = json.loads(path.read_text())
        change(record)
        path.write_text(json.dumps(record))
        return
    epochs = [json.loads(line) for line in path.read_text().splitlines()]
    for epoch in epochs:
        change(epoch)
    path.write_text("".join(json.dumps(e) + "\n" for e in epochs))


# Records the loader lets through (optional keys, newer writers) but that cannot be rendered:
# run name -> (file, change, what the reason names)
ODD_RECORDS = {
    "segments-cut": (
        "eval_metrics",
        lambda ev: ev["train"].update(
            segments=[
                {"world_size": 2, "hosts": ["n"], "attempt": 1, "start_step": 0},
                {"world_size": 1},
            ]
        ),
        "KeyError: 'end_step'",
    ),
    "step-none": (
        "eval_metrics",
        lambda ev: ev["train"].update(
            segments=[
                {"world_size": 2, "hosts": ["n"], "attempt": a, "start_step": 0, "end_step": None}
                for a in (1, 2)
            ]
        ),
        "TypeError",
    ),
    "params-text": ("eval_metrics", lambda ev: ev["train"].update(parameters="many"), "ValueError"),
    "notes-cut": (
        "eval_metrics",
        lambda ev: ev["provenance"].update(
            dataset={"source": "s", "sizes": {"train": 5}, "source_notes": {"skipped_corrupt": 1}}
        ),
        "KeyError: 'ignored_files'",
    ),
    "rank-hostless": (
        "train_metrics",
        lambda ep: ep.update(ranks=[{"rank": 0, "train_s": 1.0, "compute_s": 1.0}]),
        "KeyError: 'host'",
    ),
    "split-list": ("eval_metrics", lambda ev: ev.update(split=["test"]), "TypeError"),
    "no-classes": (
        "eval_metrics",
        lambda ev: ev.update(class_names=[], per_class_accuracy=[], confusion_matrix=[]),
        "no class",
    ),
    "eval-cut": ("eval_metrics", None, "not JSON"),
    "train-cut": ("train_metrics", None, "line 4 is not JSON"),
}


def test_records_that_cannot_be_rendered_are_named_and_the_rest_reported(tmp_path):
    """The report is the most robust rule: whatever a run's records hold (a key a newer or
    broken writer left out, a None or a text where a number belongs, a file cut short), the
    report is written; each run it cannot render is listed with the reason and its folder,
    the other runs render as usual, every plot included."""
    runs = [_write_run(tmp_path / "good", "good", 1, 1, 1000.0)]
    for name, (key, change, _) in ODD_RECORDS.items():
        run = _write_run(tmp_path / name, name, 2, 1, 900.0)
        if change is None:  # a writer killed mid-file
            text = run[key].read_text()
            run[key].write_text(text[: len(text) * 3 // 4])
        else:
            _edit(run[key], change)
        runs.append(run)
    paths = build_report(runs, tmp_path / "out")
    summary = json.loads(paths["summary_json"].read_text())
    assert [row["run"] for row in summary["runs"]] == ["good"]
    causes = _unfinished(paths)
    assert sorted(causes) == sorted(ODD_RECORDS)
    for name, (_, _, reason) in ODD_RECORDS.items():
        assert causes[name].startswith(f"records cannot be shown: run {name!r}"), causes[name]
        assert reason in causes[name] and str(tmp_path / name) in causes[name], causes[name]
    markdown = paths["markdown"].read_text()
    assert "Partial report: 1 of 10 runs finished" in markdown
    assert "its records cannot be shown: a rerun does not redo it" in markdown
    for name in ODD_RECORDS:
        assert f"| {_md_name(name)} | report | records cannot be shown" in markdown
    assert (tmp_path / "out/plots/confusion_good.png").read_bytes()[:8] == PNG_SIGNATURE
    assert paths["summary_csv"].read_text().startswith("run,accuracy,")


def _md_name(name: str) -> str:
    return name.replace("_", "\\_")


def test_a_none_metric_in_every_epoch_is_named(tmp_path):
    """A None where the report expects a number (a metric a writer could not compute) names
    the run, the file and the key; the other runs are reported."""
    runs = _three_runs(tmp_path)
    _edit(runs[1]["train_metrics"], lambda epoch: epoch.update(val_loss=None))
    paths = build_report(runs, tmp_path / "out")
    cause = _unfinished(paths)["<b>x"]
    assert "train_metrics" in cause and "'val_loss' has type NoneType" in cause
    assert [row["run"] for row in json.loads(paths["summary_json"].read_text())["runs"]] == [
        "r1",
        "r4",
    ]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_plot_its_numbers_cannot_draw_is_named_and_the_report_written(tmp_path):
    """An infinite throughput (a writer that divided by a zero time) cannot be drawn on an
    axis: that plot says so in its place, the rest of the report is whole."""
    runs = _three_runs(tmp_path)
    _edit(runs[2]["eval_metrics"], lambda ev: ev["train"].update(samples_per_s=float("inf")))
    out = tmp_path / "out"
    (out / "plots").mkdir(parents=True)
    (out / "plots/throughput.png").write_bytes(PNG_SIGNATURE)  # an earlier report's
    paths = build_report(runs, out)
    markdown = paths["markdown"].read_text()
    assert "Training throughput per run: not drawn (ValueError: Axis limits" in markdown
    assert "plot_throughput" not in paths and not (out / "plots/throughput.png").exists()
    assert "](plots/loss.png)" in markdown and "plot_confusion_r4" in paths
    assert len(json.loads(paths["summary_json"].read_text())["runs"]) == 3


def test_runs_evaluated_on_different_splits_show_it_and_are_not_ranked(tmp_path):
    """One run evaluated on val, one on test: a Split column says which, no star, and the
    headline says why they are not compared."""
    runs = [_write_run(tmp_path / n, n, 2, 1, 900.0) for n in ("onval", "ontest")]
    ev = json.loads(runs[0]["eval_metrics"].read_text())
    ev["split"] = "val"
    runs[0]["eval_metrics"].write_text(json.dumps(ev))
    paths = build_report(runs, tmp_path / "out")
    markdown = paths["markdown"].read_text()
    assert "| Run | Split | Evaluation accuracy |" in markdown
    assert "| onval | val |" in markdown and "| ontest | test |" in markdown
    assert "★" not in markdown
    assert "onval (eval.split val) and ontest (eval.split test) are evaluated on different" in (
        markdown
    )


PERFECT = [[33, 0, 0], [0, 33, 0], [0, 0, 34]]


def _on_split(run: dict, split: str, perfect: bool = False) -> dict:
    """Record run's evaluation as eval.split `split`; perfect: every sample right."""

    def change(ev: dict) -> None:
        ev["split"] = split
        if perfect:
            ev.update(accuracy=1.0, per_class_accuracy=[1.0] * 3, confusion_matrix=PERFECT)

    _edit(run["eval_metrics"], change)
    return run


def _section(markdown: str, heading: str) -> str:
    """The text under a heading, up to the next heading of any level."""
    return markdown.split(heading + "\n")[1].split("\n#")[0]


def _table_headers(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("| Class |")]


def test_val_and_test_runs_get_a_per_class_table_each(tmp_path):
    """One run on val, two on test, same dataset: the val run's column is in the validation
    table, the test runs share the test table, and no table holds both splits."""
    runs = [
        _on_split(_write_run(tmp_path / "onval", "onval", 2, 1, 900.0), "val", perfect=True),
        _on_split(_write_run(tmp_path / "ontest", "ontest", 2, 1, 900.0), "test"),
        _write_run(tmp_path / "older", "older", 2, 1, 900.0),  # no split: scored test
    ]
    paths = build_report(runs, tmp_path / "out")
    markdown = paths["markdown"].read_text()
    assert "## Per-class evaluation accuracy" in markdown
    assert "Runs evaluated on different splits (eval.split) are not compared" in markdown
    val = _section(markdown, "### Per-class validation accuracy")
    assert "| Class | onval |" in val and "| cat | 100.00% (33) |" in val
    test = _section(markdown, "### Per-class test accuracy")
    assert "| Class | ontest | older |" in test
    assert "| cat | 90.91% (33) | 90.91% (33) |" in test and "onval" not in test
    assert _table_headers(markdown) == ["| Class | onval |", "| Class | ontest | older |"]
    assert markdown.index("### Per-class validation") < markdown.index("### Per-class test")
    assert "![Confusion matrix: onval (validation split)](plots/confusion_onval.png)" in markdown
    assert "![Confusion matrix: ontest (test split)](plots/confusion_ontest.png)" in markdown
    page = paths["html"].read_text()
    assert "<h3>Per-class validation accuracy</h3><table><thead><tr><th>Class</th><th>onval" in (
        page.replace("\n", "")
    )


def test_runs_of_one_split_keep_one_table_headed_by_it(tmp_path):
    """Both runs on val: one table, the heading names validation, no split subheadings."""
    runs = [_on_split(_write_run(tmp_path / n, n, 2, 1, 900.0), "val") for n in ("va", "vb")]
    markdown = build_report(runs, tmp_path / "out")["markdown"].read_text()
    assert "## Per-class validation accuracy" in markdown
    assert _table_headers(markdown) == ["| Class | va | vb |"]
    assert "### Per-class" not in markdown and "not compared: each split" not in markdown


def test_with_many_runs_the_best_of_each_split_are_shown_apart(tmp_path):
    """More than MANY_RUNS runs: the per-class columns and confusion matrices go to the best
    of each split, never ranked across splits. The test runs validate worse than every val
    run; ranked together none of them would be shown."""
    on_val, on_test = MANY_RUNS - 2, 4
    runs = []
    for i in range(on_val + on_test):
        split, name = ("val", f"v{i:02d}") if i < on_val else ("test", f"t{i:02d}")
        run = _on_split(_write_run(tmp_path / name, name, 2, 1, 900.0), split)
        score = 0.9 + i / 1000 if split == "val" else 0.5 + i / 1000
        _edit(run["train_metrics"], lambda epoch, s=score: epoch.update(val_accuracy=s))
        runs.append(run)
    markdown = build_report(runs, tmp_path / "out")["markdown"].read_text()
    # the runs' columns in the order they were listed
    best_val = [f"v{i:02d}" for i in range(on_val)][-(FOCUS_RUNS // 2) :]
    best_test = [f"t{i:02d}" for i in range(on_val, on_val + on_test)]
    assert _table_headers(markdown) == [
        "| Class | " + " | ".join(best_val) + " |",
        "| Class | " + " | ".join(best_test) + " |",
    ]
    val = _section(markdown, "### Per-class validation accuracy")
    assert not re.search(r"\bt\d\d\b", val)
    test = _section(markdown, "### Per-class test accuracy")
    assert not re.search(r"\bv\d\d\b", test)
    confusion = re.findall(r"!\[Confusion matrix: (\w+) \((\w+) split\)\]", markdown)
    assert sorted(confusion) == sorted(
        [(n, "validation") for n in best_val] + [(n, "test") for n in best_test]
    )
