"""`snakemake predict` and the exports through the real workflow, as a user runs them: one
trained run (ResNet-18 on an image folder, 2 CPU ranks) predicts a copy of its own test
split, an npz of its staged test images, at 2 ranks and 1; an added image re-plans predict
and nothing else; a corrupt image is named or skipped; model.safetensors holds model.pt's
tensors, model.pt2 and model.onnx give the eager model's outputs; the loading example of
docs/use-your-model.md runs as written.

ONNX needs envs/onnx.txt (`make onnx`, which `make test` installs): without it that test
skips, and DDPFLOW_REQUIRE_ONNX=1 (CI) turns the skip into a failure.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from datafixtures import make_mixed_folder
from ddpflow import export
from workflow_helpers import REPO, jobs_planned, snakemake, write_config

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
RUN = "results/runs/default"
CONFIG = {
    "data": {"source": "image_folder", "root": "images", "image_size": [24, 24]},
    "model": {"name": "resnet18"},
    "train": {"epochs": 2, "progress": False, "global_batch_size": 16, "micro_batch_size": 8},
    "export": {"formats": ["safetensors", "torch_export", "onnx"]},
    "predict": {"input": "new_images"},
}


def _onnx_installed() -> bool:
    return all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))


def _config() -> dict:
    if _onnx_installed():
        return CONFIG
    return {**CONFIG, "export": {"formats": ["safetensors", "torch_export"]}}


def _predict(workdir: Path, configfile: Path, *args: str):
    """`snakemake predict` (the target after an option: --configfile takes every word)."""
    return snakemake(workdir, configfile, "--cores", "2", "predict", *args)


def _rows(workdir: Path) -> list[dict]:
    with (workdir / RUN / "predictions.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def _summary(workdir: Path) -> dict:
    return json.loads((workdir / RUN / "predictions.json").read_text())


def _evaluation(workdir: Path) -> dict:
    return json.loads((workdir / RUN / "eval_metrics.json").read_text())


def _confusion(rows: list[dict], truth, names: list[str]) -> list[list[int]]:
    matrix = [[0] * len(names) for _ in names]
    for row in rows:
        matrix[names.index(truth(row))][names.index(row["prediction"])] += 1
    return matrix


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One trained run (stage, train, evaluate, the exports, report) and its test images
    copied to new_images/ (outside the training data: a file added there retrains
    nothing); then `snakemake predict` at 2 ranks."""
    workdir = tmp_path_factory.mktemp("predict")
    make_mixed_folder(workdir / "images", per_class=(18, 6))
    shutil.copytree(workdir / "images/test", workdir / "new_images")
    configfile = write_config(workdir / "config.yaml", _config())
    done = snakemake(workdir, configfile)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    predicted = _predict(workdir, configfile)
    assert predicted.returncode == 0, (predicted.stdout + predicted.stderr)[-4000:]
    return workdir, configfile, predicted.stdout + predicted.stderr


def test_each_test_image_is_predicted_once_and_agrees_with_the_evaluation(trained):
    workdir, _, terminal = trained
    rows = _rows(workdir)
    files = sorted(p.relative_to(workdir / "new_images").as_posix()
                   for p in (workdir / "new_images").rglob("*") if p.is_file())  # fmt: skip
    assert [row["path"] for row in rows] == files  # one row per image, in input order
    summary = _summary(workdir)
    assert summary["inputs"] == summary["predicted"] == len(files) == 18
    assert summary["world_size"] == 2 and summary["skipped"] == []
    evaluation = _evaluation(workdir)
    names = evaluation["class_names"]
    # the evaluation's confusion matrix, image for image: the same preprocessing and model
    matrix = _confusion(rows, lambda row: row["path"].split("/")[0], names)
    assert matrix == evaluation["confusion_matrix"], (matrix, evaluation["confusion_matrix"])
    correct = sum(row["path"].split("/")[0] == row["prediction"] for row in rows)
    assert correct / len(rows) == evaluation["accuracy"]
    top = json.loads(rows[0]["top_k"])
    assert len(top) == 3 and top[0] == [rows[0]["prediction"], float(rows[0]["score"])]
    assert "predict 'default': 18 predictions on 2 ranks" in terminal


def test_an_npz_of_the_staged_test_images_gives_the_evaluations_answers(trained):
    """The staged pixels themselves: the npz path, and no decoding in between."""
    workdir, configfile, _ = trained
    staged = next((workdir / "results/staged").glob("image_folder-*"))
    manifest = json.loads((staged / "manifest.json").read_text())
    images = np.concatenate([np.load(staged / s["file"]) for s in manifest["shards"]["test"]])
    labels = np.load(staged / "test_labels.npy")
    np.savez(workdir / "test.npz", images=images)
    config = {**_config(), "predict": {"input": "test.npz"}}
    other = write_config(workdir / "npz.yaml", config)
    done = _predict(workdir, other)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = _rows(workdir)
    assert [row["path"] for row in rows] == [f"images[{i}]" for i in range(len(labels))]
    names = manifest["class_names"]
    matrix = _confusion(rows, lambda row: names[labels[int(row["path"][7:-1])]], names)
    assert matrix == _evaluation(workdir)["confusion_matrix"]
    write_config(other, {**config, "predict": {"input": "missing.npz"}})
    refused = _predict(workdir, other, "-n")
    assert refused.returncode != 0
    assert "predict.input missing.npz: no such file or folder" in refused.stderr
    _predict(workdir, configfile, "--forcerun", "predict_run")  # back to the folder


def test_the_same_predictions_at_one_rank(trained):
    workdir, configfile, _ = trained
    two = _rows(workdir)
    one_rank = {**_config(), "machine": {"cpu_ranks_per_node": 1}}
    write_config(configfile, one_rank)
    try:
        # the world size is not what predictions depend on: nothing to redo
        assert jobs_planned(workdir, configfile, "predict") == set()
        done = _predict(workdir, configfile, "--forcerun", "predict_run")
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    finally:
        write_config(configfile, _config())
    one = _rows(workdir)
    assert _summary(workdir)["world_size"] == 1
    assert [(r["path"], r["prediction"]) for r in one] == [
        (r["path"], r["prediction"]) for r in two
    ]
    for a, b in zip(one, two, strict=True):  # the same fp32 scores, up to summation order
        assert float(a["score"]) == pytest.approx(float(b["score"]), rel=1e-5, abs=1e-6)


def test_an_added_image_replans_predict_and_nothing_else(trained):
    workdir, configfile, _ = trained
    assert jobs_planned(workdir, configfile, "predict") == set()
    added = workdir / "new_images/red/zz-added.png"
    shutil.copy(workdir / "new_images/red/000.png", added)
    try:
        assert jobs_planned(workdir, configfile, "predict") == {"predict_run", "predict"}
        assert jobs_planned(workdir, configfile) == set()  # no retraining, no re-evaluation
    finally:
        added.unlink()
    # a retrained run (its science edited) predicts again, after its training, and brings
    # its evaluation and the report along: never a model newer than its metrics
    science = {**_config(), "train": {**CONFIG["train"], "optimizer": {"lr": 0.02}}}
    write_config(configfile, science)
    try:
        planned = jobs_planned(workdir, configfile, "predict")
        assert {"train", "evaluate", "report", "predict_run"} <= planned
    finally:
        write_config(configfile, _config())


def test_the_merge_writes_each_tasks_form_and_refuses_an_input_seen_twice(tmp_path):
    """Rank 0's merge, on parts as two ranks write them: multilabel and regression rows (a
    list as JSON, an empty score), the input order whatever the part order; an index given
    twice or never is a bug, not a CSV."""
    from ddpflow.training.predict_ranks import merge

    listing = {"kind": "folder", "root": str(tmp_path), "files": ["a.png", "b.png", "c.png"]}
    parts = [[{"index": 2, "prediction": 1.5, "score": None}],
             [{"index": 0, "prediction": ["cat", "dog"], "score": 0.9,
               "probabilities": [0.9, 0.8]},
              {"index": 1, "prediction": [0.5, 2.0], "score": None}]]  # fmt: skip
    out = {"predictions": tmp_path / "p.csv", "predictions_summary": tmp_path / "p.json"}

    def write(parts):
        for rank, rows in enumerate(parts):
            text = "".join(json.dumps(row) + "\n" for row in rows)
            (tmp_path / f"part-{rank}.jsonl").write_text(text)

    write(parts)
    merge(tmp_path, 2, 3, listing, out, ["h"], 0.0)
    with (tmp_path / "p.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [
        ["path", "prediction", "score", "probabilities"],
        ["a.png", '["cat", "dog"]', "0.9", "[0.9, 0.8]"],
        ["b.png", "[0.5, 2.0]", "", ""],
        ["c.png", "1.5", "", ""],
    ]
    write([parts[0] + [{"index": 2, "prediction": 1.5, "score": None}], parts[1]])
    with pytest.raises(RuntimeError, match="input 2 was predicted twice"):
        merge(tmp_path, 2, 3, listing, out, ["h"], 0.0)
    write([[], parts[1]])
    with pytest.raises(RuntimeError, match="1 input not predicted"):
        merge(tmp_path, 2, 3, listing, out, ["h"], 0.0)


def test_a_corrupt_image_is_named_or_skipped(trained):
    workdir, configfile, _ = trained
    bad = workdir / "new_images/green/broken.png"
    bad.write_bytes(b"not an image")
    before = (workdir / RUN / "predictions.csv").read_bytes()
    try:
        # refused once, while Snakemake plans (a dry run too), before any job starts
        for args in (("-n",), ()):
            refused = _predict(workdir, configfile, *args)
            assert refused.returncode != 0
            assert "1 input could not be read: green/broken.png" in refused.stderr
            assert refused.stderr.count("could not be read") == 1, refused.stderr[-3000:]
            assert "predict.on_corrupt: skip" in refused.stderr
            assert "localrule predict_run" not in refused.stdout + refused.stderr  # no job
        assert (workdir / RUN / "predictions.csv").read_bytes() == before
        write_config(configfile, {**_config(), "predict": {**CONFIG["predict"],
                                                           "on_corrupt": "skip"}})  # fmt: skip
        skipped = _predict(workdir, configfile)
        assert skipped.returncode == 0, skipped.stderr[-3000:]
        assert "18 predictions, 1 skipped (green/broken.png" in skipped.stderr
        assert _summary(workdir)["skipped"] == ["green/broken.png"]
        assert "green/broken.png" not in {row["path"] for row in _rows(workdir)}
    finally:
        bad.unlink()
        write_config(configfile, _config())


def test_predict_refuses_an_unset_input_and_unknown_runs(trained):
    workdir, _, _ = trained
    unset = write_config(workdir / "unset.yaml", {**_config(), "predict": {}})
    refused = _predict(workdir, unset, "-n")
    assert refused.returncode != 0 and "predict.input is not set" in refused.stderr
    assert snakemake(workdir, unset, "-n").returncode == 0  # only predict needs it
    unknown = write_config(workdir / "unknown.yaml", {**_config(), "predict": {"runs": ["x"]}})
    refused = snakemake(workdir, unknown, "-n")
    assert refused.returncode != 0 and "predict.runs names ['x']" in refused.stderr


# --- exports -----------------------------------------------------------------------------


def _checkpoint(workdir: Path) -> dict:
    return torch.load(workdir / RUN / "model.pt", weights_only=True)


def _eager(workdir: Path):
    from ddpflow.training.models import build_model

    checkpoint = _checkpoint(workdir)
    model = build_model(checkpoint["model"], checkpoint["shape"], checkpoint["num_classes"])
    model.load_state_dict(checkpoint["state_dict"])
    return model.eval()


def test_model_safetensors_holds_exactly_model_pts_tensors_and_their_metadata(trained):
    from safetensors import safe_open
    from safetensors.torch import load_file

    workdir, _, _ = trained
    expected = _checkpoint(workdir)["state_dict"]
    got = load_file(workdir / RUN / "model.safetensors")
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    # as readable as model.pt (safetensors itself writes 0600)
    mode = (workdir / RUN / "model.safetensors").stat().st_mode & 0o777
    assert mode == (workdir / RUN / "model.pt").stat().st_mode & 0o777
    with safe_open(workdir / RUN / "model.safetensors", "pt") as f:
        meta = f.metadata()
    evaluation = _evaluation(workdir)
    assert json.loads(meta["class_names"]) == evaluation["class_names"]
    assert json.loads(meta["input_shape"]) == [3, 24, 24]
    assert json.loads(meta["model"])["name"] == "resnet18" and meta["task"] == "classification"
    assert len(json.loads(meta["normalize_mean"])) == 3 and len(meta["data_sha256"]) == 64
    assert re.fullmatch(r"[0-9a-f]{64}", meta["config_hash"])
    from ddpflow.runtime import sha256_file

    assert meta["model_pt_sha256"] == sha256_file(workdir / RUN / "model.pt")
    report = (workdir / "results/report/report.md").read_text()
    assert "model.safetensors" in report and "model.pt2" in report
    # written by rank 0 beside model.pt, published by the export rule without torch
    export_log = (workdir / "logs/export/default.safetensors.log").read_text()
    assert "written (safetensors, by the training job)" in export_log
    assert not (workdir / "results/work/default" / export.PREPARED).exists()


def test_an_export_prepared_for_another_model_is_not_published(tmp_path):
    """A prepared export whose model.pt sha256 (or run, data, config) is not this model's
    is removed and the export made anew from model.pt."""
    from ddpflow.config import load, resolve_runs
    from safetensors.torch import save_file

    run = {**resolve_runs(load(REPO / "config/config.yaml"))[0], "name": "r"}
    run["results_dir"] = str(tmp_path / "results")
    manifest = {"files": {"train.npy": {"sha256": "0" * 64}}}
    model = tmp_path / "model.pt"
    model.write_bytes(b"model.pt as trained now")
    work = tmp_path / "results/work/r"
    work.mkdir(parents=True)
    meta = {**export._identity(run, manifest), "model_pt_sha256": "f" * 64}
    save_file({"w": torch.ones(2)}, str(work / export.PREPARED), metadata=meta)
    out = tmp_path / "model.safetensors"
    assert export._published(run, str(model), manifest, str(out)) is None
    assert not (work / export.PREPARED).exists() and not out.exists()
    from ddpflow.runtime import sha256_file

    meta["model_pt_sha256"] = sha256_file(model)  # this model's: published as it is
    save_file({"w": torch.ones(2)}, str(work / export.PREPARED), metadata=meta)
    assert export._published(run, str(model), manifest, str(out))["bytes"] > 0
    assert out.exists() and not (work / export.PREPARED).exists()


def test_the_torch_export_gives_the_eager_models_outputs_at_another_batch_size(trained):
    workdir, _, _ = trained
    program = torch.export.load(str(workdir / RUN / "model.pt2")).module()
    x = torch.randn(5, 3, 24, 24)
    with torch.no_grad():
        torch.testing.assert_close(program(x), _eager(workdir)(x), rtol=1e-4, atol=1e-5)


def test_the_onnx_export_gives_the_eager_models_outputs(trained):
    if not _onnx_installed():
        if os.environ.get("DDPFLOW_REQUIRE_ONNX") == "1":
            pytest.fail("DDPFLOW_REQUIRE_ONNX=1 but onnx/onnxscript/onnxruntime are missing")
        pytest.skip("needs envs/onnx.txt (make onnx)")
    import onnxruntime

    workdir, _, _ = trained
    session = onnxruntime.InferenceSession(str(workdir / RUN / "model.onnx"))
    x = torch.randn(7, 3, 24, 24)
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), _eager(workdir)(x), rtol=1e-4, atol=1e-4)


def test_the_docs_loading_example_classifies_as_predict_does(trained):
    """docs/use-your-model.md's first python block, run as written in the run's folder (no
    ddpflow import: a fresh interpreter with torch, torchvision, Pillow and safetensors)."""
    workdir, _, _ = trained
    page = (ROOT / "docs/use-your-model.md").read_text()
    example = re.search(r"```python\n(.*?)```", page, flags=re.S).group(1)
    assert not re.search(r"^(import|from) ddpflow", example, flags=re.M)
    image = "new_images/red/000.png"
    assert f'IMAGE = "{image}"' in example and 'EXPORT = "results/runs/default/' in example
    done = subprocess.run([sys.executable, "-c", example], cwd=workdir, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]  # runs clean, as a user copies it
    name, probability = done.stdout.split()
    (row,) = [r for r in _rows(workdir) if r["path"] == "red/000.png"]
    assert name == row["prediction"]
    assert float(probability) == pytest.approx(float(row["score"]), rel=1e-4)
