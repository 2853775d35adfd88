"""The documentation: the README's shape, the site's strict build, the generated performance
page, no dated narrative in the pages, every config example run as written (the config checks
and a real `snakemake -n`), the test map and the architecture page against the code."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from datafixtures import make_folder
from ddpflow import config as ddpconfig
from ddpflow.config.schema import deep_merge
from workflow_helpers import snakemake, snakemake_command, write_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REGENERATE = "python docs/gen_performance.py"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_performance", DOCS / "gen_performance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_performance_page_is_current():
    generated = _load_generator().generate()
    committed = (DOCS / "performance.md").read_text()
    assert committed == generated, (
        f"docs/performance.md is stale against bench/results/**/*.json: run `{REGENERATE}` "
        "and commit docs/performance.md"
    )


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        reason = "mkdocs or mkdocs-material is not installed (pip install -r envs/docs.txt)"
        if os.environ.get("DDPFLOW_REQUIRE_DOCS") == "1":
            pytest.fail(f"DDPFLOW_REQUIRE_DOCS=1 but {reason}")
        pytest.skip(reason)
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").exists()
    assert (site / "performance" / "index.html").exists()


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    assert blocks, "README.md has no fenced code block"
    first = [line.strip() for line in blocks[0].strip().splitlines()]
    assert first == ["make run", "make test"], f"the first code block is {first}"


DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")
NARRATIVE = re.compile(
    r"this session|this machine (?:was|ran)|my tests|\(issue \d+\)|measured on \d", re.I
)


def test_pages_have_no_dated_narrative():
    pages = [p for p in DOCS.rglob("*.md") if p.name != "performance.md"]
    assert pages
    found = []
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for pattern in (DATED, NARRATIVE):
                match = pattern.search(line)
                if match:
                    rel = page.relative_to(ROOT)
                    found.append(f"{rel}:{number}: {match.group(0)!r}")
    assert not found, (
        "dated narrative outside docs/performance.md (measured figures belong there, "
        "generated from bench/results):\n" + "\n".join(found)
    )


# ------------------------------------------------ the docs' config examples, run as written

PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", flags=re.M | re.S)
# the keys a `runs:` entry may override: a fragment of only these is a run of its own
RUN_SECTIONS = {"data", "model", "train", "eval", "machine", "task", "task_kwargs"}


def _fences(page: Path):
    """(language, line, dedented text) of every fenced block of a page."""
    text = page.read_text()
    for match in FENCE.finditer(text):
        line = text[: match.start()].count("\n") + 1
        yield match.group(2), line, textwrap.dedent(match.group(3))


def _config_examples() -> list[tuple[str, dict]]:
    """Every YAML block of the README and the docs pages, as (page:line, fragment)."""
    examples = []
    for page in PAGES:
        for language, line, text in _fences(page):
            if language == "yaml":
                examples.append((f"{page.relative_to(ROOT)}:{line}", yaml.safe_load(text)))
    return examples


EXAMPLES = _config_examples()


def _for_slurm(fragment: dict) -> bool:
    """A cluster's request (several nodes, a partition, an account or a staging job): the
    slurm launcher's."""
    machine = fragment.get("machine") or {}
    staging_job = (machine.get("stage") or {}).get("where") == "job"
    return (
        machine.get("nodes", 1) > 1
        or bool(machine.get("partition") or machine.get("account"))
        or staging_job
    )


def _tracker_client_missing(fragment: dict) -> bool:
    tracking = fragment.get("tracking") or {}
    modules = (["mlflow"] if "mlflow" in tracking else []) + (
        ["wandb"] if "wandb" in tracking else []
    )
    return any(importlib.util.find_spec(m) is None for m in modules)


def _shipped() -> dict:
    return yaml.safe_load((ROOT / "config/config.yaml").read_text())


@pytest.fixture(scope="module")
def docs_folder(tmp_path_factory) -> Path:
    """A user's folder holding what the examples name: the plug-ins (copied, as the pages
    say), an image folder, an npz and the sweep table printed on docs/sweeps.md."""
    folder = tmp_path_factory.mktemp("docs_examples")
    for module in ("my_data.py", "my_model.py", "my_task.py"):
        shutil.copy(ROOT / "config/examples" / module, folder / module)
    make_folder(folder / "my_images", per_class=(4, 2))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(40, 8, 8), dtype=np.uint8)
    np.savez(folder / "my_arrays.npz", train_images=images, train_labels=np.arange(40) % 4)
    (table,) = [t for lang, _, t in _fences(DOCS / "sweeps.md") if "\t" in t.splitlines()[0]]
    (folder / "sweeps").mkdir()
    (folder / "sweeps/lr.tsv").write_text(table)
    # the files the other examples name (the workflow refuses a missing data.path at once):
    # a text corpus, a token folder, the npz of a multi-label and of a regression task
    (folder / "corpus").mkdir()
    (folder / "corpus/a.txt").write_text("the docs' examples read this corpus.\n" * 200)
    (folder / "data/openwebtext").mkdir(parents=True)
    tags = (rng.random((40, 3)) < 0.5).astype(np.uint8)
    np.savez(folder / "my_tags.npz", train_images=images, train_labels=tags)
    np.savez(folder / "my_targets.npz", train_images=images, train_labels=rng.random((40, 2)))
    return folder


def test_the_docs_have_config_examples_and_every_one_is_labelled_yaml():
    assert len(EXAMPLES) >= 15, [where for where, _ in EXAMPLES]
    top = set(_shipped()) | RUN_SECTIONS | {"runs", "sweep", "tracking", "launcher"}
    unlabelled = []
    for page in PAGES:
        for language, line, text in _fences(page):
            if language in ("yaml", "bash"):
                continue
            try:
                parsed = yaml.safe_load(text)
            except yaml.YAMLError:
                continue
            if isinstance(parsed, dict) and set(parsed) <= top:
                unlabelled.append(f"{page.relative_to(ROOT)}:{line}")
    assert not unlabelled, f"config examples not marked ```yaml (so not checked): {unlabelled}"


@pytest.mark.parametrize(("where", "fragment"), EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_every_config_example_of_the_docs_passes_the_checks(
    where, fragment, docs_folder, monkeypatch
):
    """The checks common.smk makes while Snakemake reads the workflow, on the example added to
    the shipped config/config.yaml (a Slurm request under the slurm launcher)."""
    monkeypatch.chdir(docs_folder)  # relative paths (sweep.table) as Snakemake would see them
    config = deep_merge(_shipped(), fragment)
    config["launcher"] = "slurm" if _for_slurm(fragment) else "local"
    if _tracker_client_missing(fragment):  # `make tracking` first, as docs/tracking.md says
        with pytest.raises(ddpconfig.ConfigError, match="make tracking"):
            ddpconfig.check_runs(config)
        return
    checked, runs = ddpconfig.check_runs(config)
    assert runs and checked["launcher"] == config["launcher"], where


def _dry_run_batches() -> list[tuple[list[str], dict]]:
    """The examples a plain `snakemake -n` can plan here (local launcher, the trackers'
    clients installed), in few Snakemake runs: the section fragments become runs of one
    config, the others join a batch with whose keys they do not clash."""
    runs, batches = [], []
    for where, fragment in EXAMPLES:
        if _for_slurm(fragment) or _tracker_client_missing(fragment):
            continue
        name = re.sub(r"[^a-z0-9]+", "-", where.lower())
        if set(fragment) <= RUN_SECTIONS:
            runs.append((where, {"name": name, **fragment}))
            continue
        if set(fragment) == {"runs"}:
            runs += [(where, entry) for entry in fragment["runs"]]
            continue
        batch = next((b for b in batches if not set(b[1]) & set(fragment)), None)
        if batch is None:
            batches.append(batch := ([], {}))
        batch[0].append(where)
        batch[1].update(fragment)
    first = batches[0] if batches else ([], {})
    first[0].extend(sorted({where for where, _ in runs}))
    first[1]["runs"] = [entry for _, entry in runs]
    return batches or [first]


@pytest.mark.slow  # a few real Snakemake dry runs, seconds each
def test_every_workflow_example_of_the_docs_plans_with_snakemake_n(docs_folder, monkeypatch):
    """`snakemake -n` with the shipped config and the examples, in a user's folder: every run
    the examples make is planned for training (the folder holds no results yet)."""
    monkeypatch.chdir(docs_folder)
    shipped = ROOT / "config/config.yaml"
    for number, (wheres, overlay) in enumerate(_dry_run_batches()):
        overlay_file = write_config(docs_folder / f"example{number}.yaml", overlay)
        dry = snakemake(docs_folder, shipped, str(overlay_file), "-n")
        output = dry.stdout + dry.stderr
        assert dry.returncode == 0, f"{wheres}:\n{output[-3000:]}"
        runs = ddpconfig.check_runs(deep_merge(_shipped(), overlay))[1]
        trains = re.search(r"^train +(\d+)$", output, flags=re.M)
        assert trains and int(trains.group(1)) == len(runs), f"{wheres}:\n{output[-3000:]}"


# ------------------------------------------------ the test map and the architecture page

PACKAGE = ROOT / "workflow/ddpflow"


def test_the_test_map_lists_every_test_file():
    """docs/contributing.md's table names each tests/**/test_*.py (slurm/ ones as slurm/...)."""
    text = (DOCS / "contributing.md").read_text()
    files = sorted(
        p.relative_to(ROOT / "tests").as_posix() for p in ROOT.glob("tests/**/test_*.py")
    )
    assert len(files) > 40
    missing = [name for name in files if f"`{name}`" not in text]
    assert not missing, f"docs/contributing.md's test map misses {missing}"


def _architecture() -> str:
    return (DOCS / "architecture.md").read_text()


def _package_tree() -> str:
    (tree,) = [text for _, _, text in _fences(DOCS / "architecture.md") if "ddpflow/\n" in text]
    return tree


def _defined(name: str) -> bool:
    """A def or class of that name somewhere in the package (grepped, nothing imported)."""
    pattern = re.compile(rf"^\s*(?:def|class) {re.escape(name)}\b", flags=re.M)
    return any(pattern.search(p.read_text()) for p in PACKAGE.rglob("*.py"))


def test_architecture_names_every_module_of_the_package_in_its_folder():
    named, folder = set(), ""
    for line in _package_tree().splitlines()[1:]:
        head = re.match(r"^  (\w+)(/|\.py)", line)
        if head:
            folder = f"{head.group(1)}/" if head.group(2) == "/" else ""
        for name in re.findall(r"\b[\w/]+\.py\b", line):
            if "/" not in name:
                named.add(folder + name)
            elif not (ROOT / name).is_file():  # bench/x.py: the repository's; a/b.py: ours
                named.add(name)
    modules = {
        p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
    }
    assert not modules - named, f"docs/architecture.md leaves out {sorted(modules - named)}"
    assert not named - modules, (
        f"docs/architecture.md names no such module {sorted(named - modules)}"
    )


def test_architecture_names_only_modules_functions_and_classes_that_exist():
    text = _architecture()
    for dotted in set(re.findall(r"\bddpflow(?:\.\w+)+", text)):
        parts = dotted.split(".")[1:]
        path = PACKAGE.joinpath(*parts)
        module = path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
        owner = PACKAGE.joinpath(*parts[:-1]).with_suffix(".py")
        attribute = owner.is_file() and re.search(rf"\b{parts[-1]}\b", owner.read_text())
        assert module or attribute, f"docs/architecture.md names {dotted}: no such module"
    for name in set(re.findall(r"\b(\w+)\(\)", text)):
        assert _defined(name), f"docs/architecture.md names {name}(): not in the package"
    # CamelCase names are the package's classes, or these libraries' own
    theirs = {
        "DistributedSampler",
        "ZeroRedundancyOptimizer",
        "SummaryWriter",
        "TensorBoard",
        "ZeRO",
    }
    for name in set(re.findall(r"\b[A-Z][a-z0-9]+[A-Z]\w*\b", text)) - theirs:
        assert _defined(name), f"docs/architecture.md names {name}: no such class"


def test_architecture_names_every_rule():
    rules = set()
    for smk in (ROOT / "workflow/rules").glob("*.smk"):
        rules |= set(re.findall(r"^rule (\w+):", smk.read_text(), flags=re.M))
    (line,) = [x for x in _architecture().splitlines() if x.startswith("rule ")]
    assert rules and rules <= set(re.findall(r"\w+", line)), f"{sorted(rules)} vs {line!r}"


@pytest.mark.slow  # two real Snakemake dry runs
def test_running_from_another_folder_needs_the_configfile_as_getting_started_says(tmp_path):
    """`snakemake -s <clone>/Snakefile -d <folder>` reads config/config.yaml in <folder>: none
    there is refused by Snakemake naming that path; --configfile plans the whole workflow."""
    text = (DOCS / "getting-started.md").read_text()
    assert "-s ~/ddpflow/Snakefile -d ~/runs/digits --configfile" in text
    cmd, env = snakemake_command(tmp_path, None, "-n")
    bare = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bare.returncode != 0
    assert f"{tmp_path}/config/config.yaml" in bare.stdout + bare.stderr
    dry = snakemake(tmp_path, ROOT / "config/config.yaml", "-n")
    assert dry.returncode == 0 and re.search(r"^train +1$", dry.stdout + dry.stderr, flags=re.M)


# ------------------------------------------------ commands as they work after `make run`

BARE = re.compile(r"^(?:\w+=\S+ )*snakemake\b(?! --profile)")


def _commands(page: Path):
    """(line, command) of the inline code spans and bash lines of a page."""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for span in re.findall(r"`([^`]+)`", line):
            yield number, span
    for language, start, text in _fences(page):
        if language in ("bash", "sh"):
            for offset, line in enumerate(text.splitlines(), 1):
                yield start + offset, line.strip()


def test_commands_work_after_make_run():
    """`make run` leaves snakemake in .venv/bin, not on the PATH: commands say
    .venv/bin/snakemake; the user's own `snakemake --profile slurm` stays, and the pages that
    show it first say how it gets on the PATH (`source .venv/bin/activate`)."""
    found = []
    for page in [p for p in PAGES if p.name != "performance.md"]:  # generated: benchmarks
        for number, command in _commands(page):
            if command != "snakemake" and BARE.match(command):
                found.append(f"{page.relative_to(ROOT)}:{number}: {command}")
    assert not found, "bare snakemake commands (not on the PATH after make run):\n" + "\n".join(
        found
    )
    for page in (ROOT / "README.md", DOCS / "getting-started.md", DOCS / "slurm.md"):
        assert "source .venv/bin/activate" in page.read_text(), page.name


NUMBER = re.compile(r"(?<![\w.])(?<!YAML )\d+\.\d+(?![\w.])")


def test_measured_figures_are_on_the_performance_page_only():
    """A figure of the performance page's tables copied into another page's prose goes stale
    when the benchmark is run again: the pages link to the table instead."""
    tables = [x for x in (DOCS / "performance.md").read_text().splitlines() if x.startswith("|")]
    figures = {n for line in tables for n in NUMBER.findall(line) if float(n) >= 1}
    copied = []
    for page in [p for p in PAGES if p.name != "performance.md"]:
        prose = re.sub(r"`[^`]*`", "", FENCE.sub("", page.read_text()))
        copied += [f"{page.relative_to(ROOT)}: {n}" for n in NUMBER.findall(prose) if n in figures]
    assert figures and not copied, f"figures of docs/performance.md copied by hand: {copied}"


def test_the_results_and_logs_folders_configs_name_are_ignored_by_git():
    """The schema's defaults, the shipped configs' and the docs examples' results_dir and
    logs_dir (and a folder of another name the docs mention) stay out of `git status`."""
    defaults = ddpconfig.load(None, {})
    folders = {defaults["results_dir"], defaults["logs_dir"], "results-gpu", "logs_sweep"}
    for config in [*ROOT.glob("config/**/*.yaml"), *(e for _, e in EXAMPLES)]:
        config = yaml.safe_load(config.read_text()) if isinstance(config, Path) else config
        folders |= {config[key] for key in ("results_dir", "logs_dir") if key in config}
    for folder in sorted(folders):
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", "--no-index", f"{folder}/runs/x/model.pt"], cwd=ROOT
        )
        assert ignored.returncode == 0, f"{folder}/ is not ignored by .gitignore"


def test_the_pictures_of_the_report_are_current():
    """docs/img/report.png and sweep.png show what the report's code draws now: made by
    docs/make_pictures.py, which records that code's sha256 (a report that says something
    else than its picture in the README is a broken promise)."""
    spec = importlib.util.spec_from_file_location("make_pictures", DOCS / "make_pictures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    changed = module.stale()
    assert not changed, (
        f"{changed} changed since docs/img's pictures were made: run "
        "`python docs/make_pictures.py` (or `make pictures`) and commit docs/img"
    )
