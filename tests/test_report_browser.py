"""The report in a real browser: headless Chromium loads report.html, every embedded image
must decode to a picture and every in-page link must resolve.

The check runs inside the page (a script appended to a copy of it, its result dumped with
the DOM): `img.decode()` is the browser's own decoder, so a truncated or mislabelled PNG
fails here even where the HTML looks right. Needs the `chromium` package (CI installs it
from apt; DDPFLOW_REQUIRE_BROWSER=1 turns the skip into a failure).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from ddpflow import outcome
from ddpflow.paths import work_dir
from ddpflow.report import build_report
from test_report import _three_runs

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
if CHROMIUM is None:
    if os.environ.get("DDPFLOW_REQUIRE_BROWSER") == "1":
        raise RuntimeError("DDPFLOW_REQUIRE_BROWSER=1 but no chromium: apt-get install chromium")
    pytest.skip("needs chromium (apt-get install chromium)", allow_module_level=True)

CHECK = """<script>
window.addEventListener("load", async () => {
  const images = [...document.images];
  const ok = await Promise.all(
    images.map(i => i.decode().then(() => i.naturalWidth > 0 && i.naturalHeight > 0, () => false)));
  const links = [...document.querySelectorAll("a[href]")].map(a => a.getAttribute("href"));
  const result = {
    images: images.length,
    undecoded: images.filter((_, k) => !ok[k]).map(i => i.alt),
    broken: links.filter(h => !h.startsWith("#") || !document.getElementById(h.slice(1))),
    tables: document.querySelectorAll("table").length,
    title: document.title,
  };
  const out = document.createElement("pre");
  out.id = "ddpflow-check";
  out.textContent = JSON.stringify(result);
  document.body.appendChild(out);
});
</script>"""


def browse(page: Path, tmp_path: Path) -> dict:
    """Load a copy of page (with the check appended) in headless Chromium; the check's result."""
    checked = tmp_path / f"checked-{page.name}"
    checked.write_text(page.read_text().replace("</body>", CHECK + "</body>"))
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", "--dump-dom", checked.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = re.search(r'<pre id="ddpflow-check">([^<]*)</pre>', done.stdout)
    assert found, f"the page's check did not run:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def test_every_image_of_the_report_decodes_and_no_link_is_broken(tmp_path):
    paths = build_report(_three_runs(tmp_path / "runs"), tmp_path / "out")
    plots = sorted(key for key in paths if key.startswith("plot_"))
    result = browse(paths["html"], tmp_path)
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
    result = browse(broken, tmp_path)
    assert len(result["undecoded"]) == 1, result


def test_the_partial_report_of_a_failed_run_renders(tmp_path):
    from workflow_helpers import make_run

    results = tmp_path / "results"
    wild = {**make_run(), "name": "wild"}
    outcome.record_failure(work_dir(results, "wild"), "train", RuntimeError("boom"), "w.log")
    result = browse(outcome.report_unfinished({"wild": wild}, results), tmp_path)
    assert result["images"] == 0 and result["undecoded"] == [] and result["tables"] == 1
