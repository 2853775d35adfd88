"""The report in a real browser: headless Chromium loads report.html, every embedded image
must decode to a picture and every in-page link must resolve.

Playwright drives the system's Chromium and awaits a check run inside the page:
`img.decode()` is the browser's own decoder, so a truncated or mislabelled PNG fails here
even where the HTML looks right. (An earlier version appended the check to the page and read
it back with `chromium --dump-dom`: the dump raced the check's asynchronous decodes against
a virtual-time budget and lost on a loaded CI machine.) Needs the `chromium` package (CI
installs it from apt; DDPFLOW_REQUIRE_BROWSER=1 turns the skip into a failure) and the
`playwright` Python package (pinned in envs/requirements.txt; its own browser downloads are
never used).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from ddpflow.errors import UserError
from ddpflow.paths import work_dir
from ddpflow.report import outcome
from ddpflow.report.build import build_report
from test_report import _three_runs

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
if CHROMIUM is None:
    if os.environ.get("DDPFLOW_REQUIRE_BROWSER") == "1":
        raise RuntimeError("DDPFLOW_REQUIRE_BROWSER=1 but no chromium: apt-get install chromium")
    pytest.skip("needs chromium (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip)")

CHECK = """async () => {
  const images = [...document.images];
  const ok = await Promise.all(
    images.map(i => i.decode().then(() => i.naturalWidth > 0 && i.naturalHeight > 0, () => false)));
  const links = [...document.querySelectorAll("a[href]")].map(a => a.getAttribute("href"));
  return {
    images: images.length,
    undecoded: images.filter((_, k) => !ok[k]).map(i => i.alt),
    broken: links.filter(h => !h.startsWith("#") || !document.getElementById(h.slice(1))),
    tables: document.querySelectorAll("table").length,
    title: document.title,
    text: document.body.innerText,
  };
}"""


def browse(page: Path) -> dict:
    """Load page in headless Chromium, wait for its load event, return the check's result."""
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            tab = browser.new_page()
            tab.goto(page.resolve().as_uri(), wait_until="load", timeout=120_000)
            return tab.evaluate(CHECK)
        finally:
            browser.close()


def test_every_image_of_the_report_decodes_and_no_link_is_broken(tmp_path):
    paths = build_report(_three_runs(tmp_path / "runs"), tmp_path / "out")
    plots = sorted(key for key in paths if key.startswith("plot_"))
    result = browse(paths["html"])
    assert result["title"] == "ddpflow report"
    assert result["images"] == len(plots) >= 8, result  # loss ... scaling, 3 confusion matrices
    assert result["undecoded"] == [] and result["broken"] == [], result
    assert result["tables"] >= 4
    # report.md links its images as files beside it: each must exist
    markdown = paths["markdown"].read_text()
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert len(linked) == len(plots)
    assert all((paths["markdown"].parent / link).is_file() for link in linked)


def test_a_broken_image_is_caught(tmp_path):
    """The check can fail: a PNG cut short in the page is reported by its caption."""
    paths = build_report(_three_runs(tmp_path / "runs"), tmp_path / "out")
    page = paths["html"].read_text()
    start = page.index("data:image/png;base64,") + len("data:image/png;base64,")
    broken = tmp_path / "broken.html"
    broken.write_text(page[:start] + page[start + 40 :])  # the PNG's header and IHDR gone
    result = browse(broken)
    assert len(result["undecoded"]) == 1, result


def test_the_partial_report_of_a_failed_run_renders(tmp_path):
    from workflow_helpers import make_run

    results = tmp_path / "results"
    wild = {**make_run(), "name": "wild"}
    outcome.record_failure(work_dir(results, "wild"), "train", RuntimeError("boom"), "w.log")
    result = browse(outcome.report_unfinished({"wild": wild}, results))
    assert result["images"] == 0 and result["undecoded"] == [] and result["tables"] == 1


def _stage_failed(results, run: dict) -> None:
    work = outcome.staging_work(results, run["dataset_id"])
    outcome.record_failure(work, "stage", UserError("data.path missing.npz: no such file"), "s.log")


def _interrupted(results, run: dict) -> None:
    outcome.record_failure(work_dir(results, run["name"]), "train", KeyboardInterrupt(), "t.log")


FAILURES = {  # what each kind of failure leaves for the report (ddpflow.report.outcome)
    "train-failed": (lambda r, run: outcome.record_failure(
        work_dir(r, run["name"]), "train", RuntimeError("boom"), "t.log"), "RuntimeError: boom"),
    "stage-failed": (_stage_failed, "data.path missing.npz: no such file"),
    "interrupted": (_interrupted, "stopped (Ctrl-C or a signal to Snakemake)"),
    "not-run": (lambda r, run: None, outcome.NOT_RUN),
}  # fmt: skip


@pytest.mark.parametrize("kind", [*FAILURES, "stopped-retrain"])
def test_the_report_after_each_kind_of_failure_reads_in_the_browser(tmp_path, kind):
    """A finished run beside one that failed: in its staging, its training, stopped (also
    while retraining a finished run: its previous outputs given back), or not run at all.
    Every image of the finished run decodes, no link is broken, the failed run is named with
    its cause and the page says how to go on."""
    from test_outcome import _publish
    from workflow_helpers import make_run

    results = tmp_path / "results"
    ok = {**make_run(), "name": "ok"}
    npz = make_run(data={"source": "npz", "path": "missing.npz"})
    other = {**(npz if kind == "stage-failed" else make_run(train={"epochs": 6})), "name": "other"}
    _publish(results, ok, ok)
    restored = []
    if kind == "stopped-retrain":  # the last config's result, given back by ddpflow.kept
        _publish(results, other, {**other, "train": {**other["train"], "epochs": 2}})
        restored = ["other"]
    record, cause = FAILURES.get(kind, FAILURES["interrupted"])
    record(results, other)
    html = outcome.report_unfinished({"ok": ok, "other": other}, results, restored)
    result = browse(html)
    assert result["images"] >= 3 and result["undecoded"] == [] and result["broken"] == [], result
    assert "1 of 2 runs finished" in result["text"] and cause in result["text"], result["text"]
    assert "run the same snakemake command again" in result["text"]


def test_a_sweep_of_100_runs_reads_in_the_browser(tmp_path):
    """100 sweep runs: every image decodes, no table makes the page wider than the window
    (a per-class column per run did: 9,600 px), the ranking's top is in view; the screenshot
    is kept (DDPFLOW_SCREENSHOT_DIR, else tmp_path) to look at."""
    from test_report_sweep import synthetic_sweep

    paths = build_report(synthetic_sweep(tmp_path / "runs", 100), tmp_path / "out")
    shots = Path(os.environ.get("DDPFLOW_SCREENSHOT_DIR", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            tab = browser.new_page(viewport={"width": 1280, "height": 900})
            tab.goto(paths["html"].resolve().as_uri(), wait_until="load", timeout=120_000)
            result = tab.evaluate(CHECK)
            width = tab.evaluate("() => document.documentElement.scrollWidth")
            ranking = tab.evaluate("() => document.querySelectorAll('table')[0].rows.length")
            tab.screenshot(path=str(shots / "sweep-100-top.png"))
        finally:
            browser.close()
    assert result["undecoded"] == [] and result["broken"] == [], result
    assert result["images"] == len([k for k in paths if k.startswith("plot_")])
    assert width <= 1280, width
    assert ranking == 21  # header + the top 20; the other 80 folded below
    assert (shots / "sweep-100-top.png").stat().st_size > 10_000


def test_a_report_of_every_task_reads_in_the_browser(tmp_path):
    """A classification, a multilabel and a regression run: every image (the heatmap of
    predicted against true values included) decodes and the page fits the window."""
    from test_report_tasks import classification_eval, multilabel_eval, regression_eval, write_run

    runs = [
        write_run(tmp_path, "cls", classification_eval("cls")),
        write_run(tmp_path, "ml", multilabel_eval("ml")),
        write_run(tmp_path, "reg", regression_eval("reg", 0.2)),
    ]
    paths = build_report(runs, tmp_path / "out")
    result = browse(paths["html"])
    assert "plot_predicted_vs_true_reg" in paths
    assert result["images"] == len([k for k in paths if k.startswith("plot_")]), result
    assert result["undecoded"] == [] and result["broken"] == [], result
