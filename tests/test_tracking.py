"""Experiment trackers (ddpflow.tracking, docs/tracking.md): the track rule logs each run to
a real MLflow server, a sqlite database and W&B offline, read back with the trackers' own
tools; an unreachable server fails that rule alone; the tracking keys are in no fingerprint.

The tests that need mlflow or wandb skip without them (`make tracking`; `make test` installs
them) unless DDPFLOW_REQUIRE_TRACKING=1 (CI), which turns the skip into a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from ddpflow import config as ddpconfig
from ddpflow.config import ConfigError
from ddpflow.config.fingerprint import flatten
from ddpflow.tracking.record import param_value
from workflow_helpers import BIN, jobs_planned, snakemake, write_config

TWO_EPOCHS = {"train": {"epochs": 2, "progress": False}}


def need(*modules: str) -> None:
    """Skip (or, with DDPFLOW_REQUIRE_TRACKING=1, fail) where a tracker's client is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    reason = f"needs {', '.join(missing)} (make tracking)"
    if os.environ.get("DDPFLOW_REQUIRE_TRACKING") == "1":
        pytest.fail(f"DDPFLOW_REQUIRE_TRACKING=1 but {reason}")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tracked(workdir: Path, tracking: dict, **more) -> subprocess.CompletedProcess:
    configfile = write_config(workdir / "config.yaml", {**TWO_EPOCHS, **more, "tracking": tracking})
    return snakemake(workdir, configfile)


# -- a real MLflow server on loopback, started here and stopped by its process id -----------


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    need("mlflow", "flask")  # the server is full mlflow's (envs/tracking-server.txt)
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = (root / "server.log").open("w")
    server = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{root}/mlflow.db",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()}")
            time.sleep(1)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its uvicorn workers are in its group
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.fixture(scope="module")
def served_run(mlflow_server, tmp_path_factory):
    """The shipped config, two epochs, logged by the workflow to the server."""
    workdir = tmp_path_factory.mktemp("served")
    served = {"mlflow": {"uri": mlflow_server, "experiment": "served"}}
    result = tracked(workdir, served, export={"formats": ["safetensors"]})
    assert result.returncode == 0, result.stderr[-4000:]
    return workdir


def runs_of(uri: str, experiment: str, name: str = "default"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    runs = client.search_runs([found.experiment_id], filter_string=f"tags.`ddpflow.run` = '{name}'")
    return client, runs


@pytest.mark.e2e
@pytest.mark.slow
def test_a_real_mlflow_server_receives_the_two_epoch_run(mlflow_server, served_run):
    evaluation = json.loads((served_run / "results/runs/default/eval_metrics.json").read_text())
    record = json.loads((served_run / "results/runs/default/tracking.json").read_text())
    entry = record["trackers"]["mlflow"]
    client, runs = runs_of(mlflow_server, "served")
    assert [r.info.run_id for r in runs] == [entry["run_id"]]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "default"
    assert (
        entry["url"]
        == f"{mlflow_server}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    )
    # params: the resolved config, flattened, as config.yaml writes its values
    config = evaluation["provenance"]["config"]
    # (less tracking: itself, which says where it is logged, not what the run is)
    flat = flatten({k: v for k, v in config.items() if k != "tracking"})
    assert run.data.params == {k: param_value(v) for k, v in flat.items()}
    assert "tracking.mlflow.uri" in flatten(config)
    assert run.data.params["train.epochs"] == "2"
    # one point per epoch per figure, equal to train_metrics.jsonl's
    lines = [
        json.loads(line)
        for line in (served_run / "results/runs/default/train_metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    for figure in (
        "train_loss",
        "val_loss",
        "val_accuracy",
        "lr",
        "samples_per_s",
        "seconds.forward",
        "seconds.data",
        "rank0.samples_per_s",
        "rank1.rss_mib",
    ):
        history = client.get_metric_history(run.info.run_id, figure)
        assert [m.step for m in history] == [1, 2], figure
        field = figure.split(".")
        want = [
            line[figure]
            if len(field) == 1
            else line["seconds"][field[1]]
            if field[0] == "seconds"
            else line["ranks"][int(field[0][4:])][field[1]]
            for line in lines
        ]
        assert [m.value for m in history] == pytest.approx(want), figure
    assert run.data.metrics["test_accuracy"] == evaluation["accuracy"]
    assert run.data.metrics["test_loss"] == pytest.approx(evaluation["loss"])
    tags = run.data.tags
    assert tags["git_commit"] == str(evaluation["provenance"]["git_commit"])
    assert tags["dataset_id"] == config["dataset_id"] and tags["world_size"] == "2"
    assert tags["strategy"] == "ddp" and tags["precision"] == "fp32" and tags["hosts"]
    # streamed live by the train rule as the epochs landed, then completed by the track rule
    assert tags["ddpflow.live"] == "true" and entry["streamed_epochs"] == [1, 2]
    train_log = (served_run / "logs/train/default.log").read_text()
    assert f"streaming its epochs to MLflow {mlflow_server}, run {run.info.run_id}" in train_log
    first = client.get_metric_history(run.info.run_id, "train_loss")[0]
    published = (served_run / "results/runs/default/train_summary.json").stat().st_mtime
    assert first.timestamp < published * 1000  # logged before the training was over
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {
        "eval_metrics.json",
        "train_metrics.jsonl",
        "train_summary.json",
        "confusion_matrix.json",
        "plots",
        # the model as safetensors (export.formats' default) with its metadata, no pickle
        "model.safetensors",
        "model_metadata.json",
    } <= artifacts
    assert "model.pt" not in artifacts
    metadata = json.loads(
        Path(client.download_artifacts(run.info.run_id, "model_metadata.json")).read_text()
    )
    assert metadata["run"] == "default" and json.loads(metadata["class_names"])
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert plots == {f"plots/{n}.png" for n in ("loss", "val_accuracy", "lr", "confusion_matrix")}
    matrix = json.loads(
        Path(client.download_artifacts(run.info.run_id, "confusion_matrix.json")).read_text()
    )
    assert matrix["confusion_matrix"] == evaluation["confusion_matrix"]
    # the report names the tracker run and its URL
    report = (served_run / "results/report/report.md").read_text()
    assert "Experiment trackers" in report and entry["run_id"] in report
    summary = json.loads((served_run / "results/report/summary.json").read_text())
    assert summary["trackers"] == [
        {"run": "default", "tracker": "mlflow", "run_id": entry["run_id"], "where": entry["url"]}
    ]


@pytest.mark.e2e
@pytest.mark.slow
def test_the_mlflow_ui_in_headless_chromium_shows_the_run(mlflow_server, served_run, tmp_path):
    chromium = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
        None,
    )
    if chromium is None:
        if os.environ.get("DDPFLOW_REQUIRE_BROWSER") == "1":
            pytest.fail("DDPFLOW_REQUIRE_BROWSER=1 but no chromium: apt-get install chromium")
        pytest.skip("needs chromium (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip)")
    entry = json.loads((served_run / "results/runs/default/tracking.json").read_text())
    entry = entry["trackers"]["mlflow"]
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            tab = browser.new_page(viewport={"width": 1400, "height": 900})
            # the experiment's runs table, then the run's own page (tracking.json's URL)
            # (its Overview opens on GenAI traces: the runs have a page of their own)
            experiment = f"{mlflow_server}/#/experiments/{entry['experiment_id']}/runs"
            tab.goto(experiment, timeout=120_000)
            tab.get_by_text("default", exact=True).first.wait_for(timeout=120_000)
            tab.screenshot(path=tmp_path / "mlflow-experiment.png", full_page=True)
            listing = tab.inner_text("body")
            tab.goto(entry["url"], timeout=120_000)
            tab.get_by_text("test_accuracy").first.wait_for(timeout=120_000)
            tab.screenshot(path=tmp_path / "mlflow-run.png", full_page=True)
            page = tab.inner_text("body")
        finally:
            browser.close()
    assert "default" in listing.split()
    assert "default" in page and "test_accuracy" in page and entry["run_id"] in page
    for png in ("mlflow-experiment.png", "mlflow-run.png"):
        assert (tmp_path / png).stat().st_size > 10_000


# -- sqlite, no server: a rerun logs nothing, a retrained run is a new tracker run -----------


@pytest.mark.e2e
@pytest.mark.slow
def test_sqlite_without_a_server_logs_once_and_a_retrained_run_supersedes(workdir):
    need("mlflow", "sqlalchemy", "alembic")
    uri = "sqlite:///results/mlflow.db"
    sqlite = {"mlflow": {"uri": uri, "experiment": "laptop"}}
    assert tracked(workdir, sqlite).returncode == 0
    absolute = f"sqlite:///{workdir}/results/mlflow.db"
    _, runs = runs_of(absolute, "laptop")
    assert len(runs) == 1
    first = runs[0].info.run_id
    assert (workdir / "results/mlflow-artifacts").is_dir()
    # a rerun: nothing to do; the track rule forced again logs nothing either (its guard)
    configfile = workdir / "config.yaml"
    assert jobs_planned(workdir, configfile) == set()
    forced = snakemake(workdir, configfile, "--forcerun", "track")
    assert forced.returncode == 0, forced.stderr[-3000:]
    _, runs = runs_of(absolute, "laptop")
    assert [r.info.run_id for r in runs] == [first]
    log = (workdir / "logs/track/default.log").read_text()
    assert "already logged" in log
    # editing tracking: redoes the track rule and the report, nothing trained or evaluated
    write_config(
        configfile, {**TWO_EPOCHS, "tracking": {"mlflow": {"uri": uri, "experiment": "other"}}}
    )
    assert jobs_planned(workdir, configfile) == {"track", "report", "all"}
    # retrained (another learning rate): a new tracker run; the old one tagged superseded
    retrain = {"train": {**TWO_EPOCHS["train"], "optimizer": {"lr": 0.02}}}
    assert tracked(workdir, sqlite, **retrain).returncode == 0
    client, runs = runs_of(absolute, "laptop")
    assert len(runs) == 2
    new = next(r for r in runs if r.info.run_id != first)
    old = client.get_run(first)
    assert old.data.tags["ddpflow.superseded"] == "true"
    assert old.data.tags["ddpflow.superseded_by"] == new.info.run_id
    assert "ddpflow.superseded" not in new.data.tags
    assert new.data.params["train.optimizer.lr"] == "0.02"
    record = json.loads((workdir / "results/runs/default/tracking.json").read_text())
    assert record["trackers"]["mlflow"]["superseded"] == [first]


# -- W&B offline: a run folder that wandb's own reader reads back --------------------------


@pytest.mark.e2e
@pytest.mark.slow
def test_wandb_offline_writes_a_run_that_wandb_reads_back(workdir, monkeypatch):
    need("wandb")
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # nothing goes to the network, whatever else
    monkeypatch.setenv("WANDB_DIR", str(workdir / "results/wandb"))
    result = tracked(workdir, {"wandb": {"mode": "offline", "project": "offline-test"}})
    assert result.returncode == 0, result.stderr[-4000:]
    entry = json.loads((workdir / "results/runs/default/tracking.json").read_text())
    entry = entry["trackers"]["wandb"]
    run_dir = Path(entry["dir"])
    assert run_dir.parent == workdir / "results/wandb/wandb"
    assert run_dir.name.startswith("offline-run-") and run_dir.name.endswith(entry["run_id"])
    assert entry["sync"] == f"wandb sync {run_dir}"
    # W&B's own reader of the .wandb transaction log (wandb leet inspect, wandb 0.31)
    read = subprocess.run(
        [str(BIN / "wandb"), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert read.returncode == 0, read.stderr
    records = [json.loads(line) for line in read.stdout.splitlines() if line.strip()]
    text = read.stdout
    lines = [
        json.loads(line)
        for line in (workdir / "results/runs/default/train_metrics.jsonl").read_text().splitlines()
    ]
    history = [r for r in records if r.get("type") == "history"]
    assert len(history) == 2, text[:3000]
    for line, record in zip(lines, history, strict=True):
        dumped = json.dumps(record)
        assert '"train_loss"' in dumped and json.dumps(line["train_loss"]) in dumped
    summary = subprocess.run(
        [str(BIN / "wandb"), "leet", "inspect", "--summary", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert summary.returncode == 0, summary.stderr
    evaluation = json.loads((workdir / "results/runs/default/eval_metrics.json").read_text())
    assert (
        json.dumps(evaluation["accuracy"]) in summary.stdout and "test_accuracy" in summary.stdout
    )
    # and `wandb sync` knows it as a run to upload (dry run: nothing leaves the machine)
    dry = subprocess.run(
        [str(BIN / "wandb"), "sync", "--dry-run", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    assert entry["run_id"] in dry.stdout + dry.stderr


# -- a tracker that cannot be reached fails its rule alone --------------------------------


@pytest.mark.e2e
@pytest.mark.slow
def test_an_unreachable_server_fails_the_track_rule_alone_and_the_report_is_written(workdir):
    need("mlflow")
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = tracked(workdir, {"mlflow": {"uri": uri}})
    assert result.returncode != 0
    assert "Error in rule track" in result.stderr
    assert f"MLflow tracking server {uri} cannot be reached" in result.stderr
    for rule in ("train", "evaluate", "report"):
        assert f"Error in rule {rule}" not in result.stderr
    runs = workdir / "results/runs/default"
    assert (runs / "eval_metrics.json").is_file() and not (runs / "tracking.json").exists()
    summary = json.loads((workdir / "results/report/summary.json").read_text())
    assert [row["run"] for row in summary["runs"]] == ["default"]  # reported as finished
    assert summary["unfinished"] == []
    (row,) = summary["trackers"]
    assert row["run"] == "default" and row["tracker"] == "mlflow"
    assert uri in row["where"] and row["where"].startswith("failed: ")
    report = (workdir / "results/report/report.md").read_text()
    assert "Runs that did not finish" not in report and uri in report


# -- configuration: no fingerprint, refusals ----------------------------------------------


def _ids(config: dict) -> tuple:
    run = ddpconfig.resolve_runs(ddpconfig.validate(config))[0]
    return (
        run["dataset_id"],
        ddpconfig.stage_params(run["data"]),
        ddpconfig.training_fingerprint(run),
        ddpconfig.evaluation_fingerprint(run),
    )


def test_tracking_keys_are_in_no_fingerprint():
    off = _ids({})
    on = {
        "mlflow": {"uri": "http://mlflow.site:5000", "experiment": "x"},
        "wandb": {"mode": "online", "project": "p", "entity": "me"},
    }
    assert _ids({"tracking": on}) == off
    assert not any(key.startswith("tracking") for key in flatten(off))


def test_tracking_is_off_by_default_and_a_bare_yaml_off_means_off():
    import yaml

    assert ddpconfig.load(None, {})["tracking"] == {
        "mlflow": {"uri": None, "experiment": "ddpflow"},
        "wandb": {"mode": "off", "project": "ddpflow", "entity": None},
    }
    config = ddpconfig.load(None, yaml.safe_load("tracking: {wandb: {mode: off}}"))
    assert config["tracking"]["wandb"]["mode"] == "off"
    assert not ddpconfig.tracking_enabled(config["tracking"])


def test_enabling_a_tracker_without_its_client_is_refused_naming_make_tracking(monkeypatch):
    """The client is made missing by a find_spec that knows no mlflow or wandb (the check
    asks importlib.util.find_spec, and imports nothing)."""
    real = importlib.util.find_spec
    hidden = ("mlflow", "wandb", "sqlalchemy", "alembic")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a)
    )
    for tracking, key in (
        ({"mlflow": {"uri": "http://mlflow.site:5000"}}, "tracking.mlflow.uri"),
        ({"mlflow": {"uri": "sqlite:///results/mlflow.db"}}, "tracking.mlflow.uri"),
        ({"wandb": {"mode": "offline"}}, "tracking.wandb.mode"),
    ):
        with pytest.raises(ConfigError, match=r"make tracking") as refused:
            ddpconfig.load(None, {"tracking": tracking})
        assert str(refused.value).startswith(key)
    monkeypatch.undo()


def test_a_missing_client_stops_the_workflow_before_anything_runs(workdir, tmp_path):
    """The same refusal from snakemake itself, the client hidden for real: a module called
    mlflow that cannot be found (a meta path finder in a sitecustomize that says so)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'mlflow':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
    )
    configfile = write_config(
        workdir / "config.yaml", {**TWO_EPOCHS, "tracking": {"mlflow": {"uri": "http://h:5000"}}}
    )
    env = {"PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    result = snakemake(workdir, configfile, "-n", env=env)
    assert result.returncode != 0
    assert "make tracking" in result.stderr and "tracking.mlflow.uri" in result.stderr
    assert not (workdir / "results").exists()


def test_the_deprecated_mlflow_file_store_is_refused():
    for uri in ("mlruns", "file:///tmp/mlruns"):
        with pytest.raises(ConfigError, match="sqlite:///"):
            ddpconfig.load(None, {"tracking": {"mlflow": {"uri": uri}}})


# -- what a tracker receives of a run of each task (tracking.record), without a tracker -------


def _recorded(tmp_path: Path, name: str, evaluation: dict):
    """record.collect of a run whose results/runs/<name>/ holds the evaluation given."""
    from types import SimpleNamespace

    from ddpflow.tracking.record import collect
    from test_report_tasks import write_run

    evaluation["provenance"]["config"] = {
        "dataset_id": "d1",
        "train": {"strategy": "ddp", "precision": "fp32", "epochs": 4},
    }
    files = write_run(tmp_path / "results", name, evaluation)
    model = files["eval_metrics"].parent / "model.pt"
    model.write_bytes(b"weights")
    paths = SimpleNamespace(
        model=model,
        train_metrics=files["train_metrics"],
        train_summary=files["eval_metrics"].parent / "train_summary.json",
        eval_metrics=files["eval_metrics"],
    )
    return collect({"name": name, "dataset_id": "d1"}, paths, tmp_path / "tracked" / name)


def test_a_regression_run_logs_its_errors_and_predicted_vs_true_not_a_confusion(tmp_path):
    from test_report_tasks import regression_eval

    evaluation = regression_eval("reg", 0.2, r2=None)
    record = _recorded(tmp_path, "reg", evaluation)
    assert record.final == {"test_mse": 0.2, "test_mae": 0.1, "test_loss": 0.05}  # r2: none
    keys = {key for key, _, _ in record.metrics}
    assert {"val_mse", "val_mae", "val_r2", "val_loss", "train_loss", "lr"} <= keys
    assert "val_accuracy" not in keys
    r2 = [(value, step) for key, value, step in record.metrics if key == "val_r2"]
    assert [step for _, step in r2] == [1, 2, 3]  # undefined in epoch 0: not logged
    names = {path.name for path in record.artifacts}
    assert {"val_mse.png", "predicted_vs_true.png", "loss.png", "lr.png"} <= names
    assert "confusion_matrix.json" not in names and "confusion_matrix.png" not in names
    assert record.tags["task"] == "regression"
    for path in record.artifacts:
        assert path.is_file()


def test_a_multilabel_run_logs_exact_match_and_f1(tmp_path):
    from test_report_tasks import multilabel_eval

    evaluation = multilabel_eval("ml")
    record = _recorded(tmp_path, "ml", evaluation)
    assert record.final == {
        "test_exact_match": 0.62,
        "test_f1_micro": evaluation["f1_micro"],
        "test_f1_macro": evaluation["f1_macro"],
        "test_loss": 0.21,
    }
    keys = {key for key, _, _ in record.metrics}
    assert {"val_f1_micro", "val_f1_macro", "val_exact_match", "val_loss"} <= keys
    names = {path.name for path in record.artifacts}
    assert "val_f1_micro.png" in names and not any("confusion" in n for n in names)


def test_a_classification_run_logs_accuracy_and_its_confusion_matrix_as_before(tmp_path):
    from test_report_tasks import classification_eval

    record = _recorded(tmp_path, "cls", classification_eval("cls"))
    assert record.final == {"test_accuracy": 0.91}  # the fixture's record has no loss
    assert "task" not in record.tags
    names = {path.name for path in record.artifacts}
    assert {"confusion_matrix.json", "confusion_matrix.png", "val_accuracy.png"} <= names
    keys = {key for key, _, _ in record.metrics}
    assert {"val_accuracy", "val_loss", "train_loss", "lr", "samples_per_s"} <= keys
