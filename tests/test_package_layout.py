"""The package's shape: a job pickled by the previous layout still runs, every module imports,
no import circles, and the folders name the layers (issue: the package by concern).

The golden pickles in tests/golden/jobs/ were written by the layout before the move (commit
5361b0f, `ddpflow.jobs.TrainJob` / `EvalJob`) with submitit's own pickler, as
`executor.submit` writes `<job id>_submitted.pkl`; the paths inside are relative
(results/...), so the test runs them in a temporary folder.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ddpflow
import pytest
from ddpflow import pipeline
from ddpflow.cluster import jobs
from submitit.core.utils import DelayedSubmission, pickle_load

GOLDEN = Path(__file__).parent / "golden" / "jobs"
PACKAGE = Path(ddpflow.__file__).parent
LAYERS = {"checks", "cluster", "config", "data", "monitoring", "report", "task", "tracking",
          "training", "tutorial"}  # fmt: skip
# `# fmt: skip` comments in the package: each holds a hand-made shape (often a long argument
# list) in place; the count may only go down (lower it here when you remove some)
FMT_SKIPS = 83


def _node_side(folder: Path, job_id: str, cwd: Path) -> subprocess.CompletedProcess:
    """What a node runs for a submitit job: `python -m submitit.core._submit <folder>`, one
    task, with the local executor's environment (no SLURM_* variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.update(
        SUBMITIT_EXECUTOR="local", SUBMITIT_LOCAL_JOB_ID=job_id, SUBMITIT_LOCAL_NTASKS="1",
        SUBMITIT_LOCAL_GLOBALID="0", SUBMITIT_LOCAL_LOCALID="0", SUBMITIT_LOCAL_NODEID="0",
        SUBMITIT_LOCAL_JOB_NUM_NODES="1", SUBMITIT_STDERR_TO_STDOUT="",
    )  # fmt: skip
    command = [sys.executable, "-u", "-m", "submitit.core._submit", str(folder)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_old_pickles_resolve_to_the_moved_classes():
    for name, cls in (("train", jobs.TrainJob), ("eval", jobs.EvalJob)):
        delayed = DelayedSubmission.load(GOLDEN / f"{name}_submitted.pkl")
        assert type(delayed.function) is cls, type(delayed.function)
    # a requeue (checkpoint()) pickles the moved class again: the same job, resubmitted
    train = DelayedSubmission.load(GOLDEN / "train_submitted.pkl").function
    again = train.checkpoint()
    assert isinstance(again, DelayedSubmission) and again.function is train


@pytest.mark.e2e
def test_a_job_submitted_before_the_move_runs_and_its_result_is_read(tmp_path):
    delayed = DelayedSubmission.load(GOLDEN / "train_submitted.pkl")
    run, paths = delayed.function.run, delayed.function.paths
    os.chdir(tmp_path)  # the pickled paths are relative: results/...
    try:
        pipeline.stage_data(run["data"], paths.staged)
    finally:
        os.chdir(Path(__file__).parent.parent)
    folder = tmp_path / "logs" / "submitit"
    folder.mkdir(parents=True)
    shutil.copy(GOLDEN / "train_submitted.pkl", folder / "4242_submitted.pkl")

    done = _node_side(folder, "4242", tmp_path)

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    status, summary = pickle_load(folder / "4242_0_result.pkl")
    assert status == "success", summary
    assert summary["run"] == run["name"] == "default"
    assert summary["epochs"] == 1 and summary["world_size"] == 1
    assert (tmp_path / paths.model).is_file()


def _modules():
    return [m.name for m in pkgutil.walk_packages([str(PACKAGE)], "ddpflow.")]


def _source(name: str) -> Path:
    """A module's own file (not importlib's spec: an old path that makes itself its new
    module in sys.modules would read as the new file once imported)."""
    path = PACKAGE.joinpath(*name.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_every_module_imports():
    for name in _modules():
        importlib.import_module(name)


def _imports_of(path: Path) -> set[str]:
    """ddpflow modules a file imports at module level or in functions (absolute imports, and
    importlib.import_module with a literal name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddpflow"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ddpflow"))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            named = node.args[0] if node.args else None  # importlib.import_module("ddpflow.x")
            if isinstance(named, ast.Constant) and str(named.value).startswith("ddpflow"):
                found.add(named.value)
    return found


def test_no_import_circles():
    modules = set(_modules())
    graph = {}
    for name in modules:
        graph[name] = {m for m in _imports_of(_source(name)) if m in modules and m != name}
        graph[name] -= {p for p in graph[name] if name.startswith(p + ".")}  # own packages
    circles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_folders_name_the_layers():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders == LAYERS
    for layer in LAYERS:
        assert ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))


def test_the_login_node_modules_import_no_torch():
    """Every rule imports these on the login node (and Snakemake's parse imports config):
    torch would add seconds to each rule and is needed only on the ranks."""
    code = (
        "import sys, ddpflow.pipeline, ddpflow.config, ddpflow.checks.slurm, "
        "ddpflow.checks.early, ddpflow.checks.values, ddpflow.cluster.submit, "
        "ddpflow.report.build, ddpflow.report.outcome, ddpflow.cluster.interrupts, "
        "ddpflow.tracking.track, ddpflow.tracking.record; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_no_module_over_400_lines_and_no_function_over_50():
    """The package's shape: files a newcomer can read whole, functions that do one thing."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        rel = path.relative_to(PACKAGE)
        generated = "GENERATED by" in source[:300]  # config/typed.py: written from the schema
        if source.count("\n") > 400 and not generated:
            too_long.append(f"{rel}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 50:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "split these: " + "; ".join(too_long)


def test_no_text_counts_with_an_s_in_brackets():
    """What the terminal, the logs and the report print says '1 run', '3 runs' (ddpflow.words.
    counted), never 'run(s)': no string in the package or the rule scripts holds a word
    followed by '(s)'."""
    found = []
    for path in [*PACKAGE.rglob("*.py"), *(PACKAGE.parents[1] / "scripts").glob("*.py")]:
        if path == PACKAGE / "words.py":  # its docstring names what it replaces
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and re.search(r"[A-Za-z]\(s\)", text):
                found.append(f"{path.relative_to(PACKAGE.parents[1])}:{node.lineno}")
    assert not found, found


def test_the_fmt_skip_count_only_goes_down():
    found = sum(path.read_text().count("# fmt: skip") for path in PACKAGE.rglob("*.py"))
    assert found <= FMT_SKIPS, (
        f"{found} `# fmt: skip` in the package, {FMT_SKIPS} allowed: let the formatter shape "
        "new code (fewer, typed arguments instead of long lists)"
    )


# Login-node layers, lowest first: a layer imports only those below it. config is what the
# user wrote and what it means; cluster gets ranks onto machines (its Slurm queries, the
# launcher, rank discovery); checks are made before the work starts, from both.
LAYER_ORDER = ("config", "cluster", "checks")
# known imports against that order, each with why; empty the list as they go
UPWARD_IMPORTS = {
    # names the checks keep through ddpflow.config for callers written before ddpflow.checks
    # (bench/scaling.py and tests call ddpconfig.check_world_size, run_warnings, ...)
    ("ddpflow.config", "checks"),
    # config/runs.py resolves every run and checks it (ddpflow.checks.values, .batch)
    ("ddpflow.config.runs", "checks"),
    # old module paths, kept until their importers move (config/weights.py: for good, as
    # scripts/fetch_weights.py names it and a rule script is never edited)
    ("ddpflow.config.weights", "checks"),  # scripts/fetch_weights.py, runs.py, training/*
    # placement re-checks a run at the node count it can get (machine.min_nodes)
    ("ddpflow.cluster.placement", "checks"),
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYER_ORDER else None


def test_the_login_layers_import_one_way():
    """config imports neither cluster nor checks, cluster does not import checks (imports
    inside functions count: a deferred import is still a dependency)."""
    against = set()
    for name in _modules():
        own = _layer(name)
        if own is None:
            continue
        for target in {_layer(m) for m in _imports_of(_source(name))} - {None, own}:
            if LAYER_ORDER.index(target) > LAYER_ORDER.index(own):
                against.add((name, target))
    assert against <= UPWARD_IMPORTS, sorted(against - UPWARD_IMPORTS)


# modules that use another module's private name, each owned by another change in flight;
# empty the list as they go
PRIVATE_USES: set[str] = set()


def _module_names(tree: ast.AST, modules: set[str]) -> dict[str, str]:
    """Local name -> ddpflow module, for every import of a ddpflow module in the file."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ddpflow") and a.asname:
                    bound[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpflow"):
            for a in node.names:
                if f"{node.module}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return bound


def _private_uses(name: str, modules: set[str]) -> list[str]:
    tree = ast.parse(_source(name).read_text())
    bound, found = _module_names(tree, modules), []

    def private(attr: str) -> bool:
        return attr.startswith("_") and not attr.startswith("__")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpflow"):
            if node.module != name:
                found += [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = bound.get(node.value.id)
            if module and module != name and private(node.attr):
                found.append(f"{module}.{node.attr}")
    return [f"{name}: {use}" for use in found]


def test_no_module_uses_another_modules_private_names():
    """`from x import _y` and `x._y` across modules: a seam that is used is public, named
    without the underscore."""
    modules = set(_modules())
    found = {name: _private_uses(name, modules) for name in sorted(modules)}
    users = {name for name, uses in found.items() if uses}
    assert users <= PRIVATE_USES, [u for name in sorted(users - PRIVATE_USES) for u in found[name]]
    assert not PRIVATE_USES - users, f"fixed, take off the list: {PRIVATE_USES - users}"
