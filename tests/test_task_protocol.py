"""The task protocol holds: nothing in ddpflow outside ddpflow/task/ knows which task runs.
No string literal naming a built-in task (docstrings aside) and no comparison with a task
name constant outside task/ and the config schema; a task's decisions are the protocol's
hooks (ddpflow.task.base.Task), whose defaults let a user's task override only what it
needs. Fast: it reads the package's source, and checks the defaults in process."""

from __future__ import annotations

import ast
from pathlib import Path

import ddpflow
import numpy as np
from ddpflow.task import BUILT_IN_TASKS, Selection, Task, get_task, manifest_task, record_task

PACKAGE = Path(ddpflow.__file__).parent
# where naming a task is the point: the tasks themselves, the schema and the typed config
# written from it (its default task)
ALLOWED = ("task/", "config/schema", "config/typed.py", "config/typed_gen.py")
NAME_CONSTANTS = {"DEFAULT_TASK", "CLASSIFICATION", "LANGUAGE_MODEL"}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _named(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def test_no_code_outside_task_names_a_built_in_task():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(ALLOWED):
            continue
        tree = ast.parse(path.read_text())
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and node.value in BUILT_IN_TASKS
                and id(node) not in docstrings
            ):
                found.append(f"{rel}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_named(side) in NAME_CONSTANTS for side in sides):
                    found.append(f"{rel}:{node.lineno} compares with a task name")
    assert not found, "ask the task (ddpflow.task.base.Task) instead: " + "; ".join(found)


class Bare(Task):
    """A user's task with only what the protocol requires."""

    name = "bare"
    selection = Selection("val_score", True, "validation score")
    headline = ("score",)


def test_a_tasks_defaults_are_the_generic_ones():
    task = Bare()
    assert task.reads == "images" and task.stages_targets and task.named_in_records
    assert task.exports is None and not task.can_predict()
    targets = {"train": np.zeros((4, 2), np.float32), "test": np.zeros((2, 2), np.float32)}
    record = task.manifest_record(targets, ["a", "b"])
    assert record == {"task": "bare", "target_dtype": "float32", "target_shape": [2]}
    assert task.target_layout(record, 3) == (np.dtype("float32"), (3, 2))
    assert task.epoch_fields() == {"val_score": (int, float)}
    ev = {"task": "bare", "score": 0.5, "headline": ["score"], "split": "val"}
    assert task.tracker_metrics(ev) == {"val_score": 0.5}
    assert task.report_section([], "test", "test", None, []) == []
    assert task.throughput({"samples_per_s": 12.4}) == "12 samples/s"


def test_the_built_in_tasks_answer_for_their_records_and_manifests():
    classification = get_task()
    assert record_task({}) is classification and manifest_task({}) is classification
    assert not classification.named_in_records and not classification.stages_targets
    lm = get_task("language_model")
    assert lm.reads == "tokens" and lm.exports == ("safetensors",) and not lm.can_predict()
    assert manifest_task({"task": "regression", "num_classes": 2}).target_layout(
        {"num_classes": 2}, 5
    ) == (np.dtype("float32"), (5, 2))
    # a plug-in task's manifest: read by its recorded layout, no import of its code
    plugin = {"task": "ordinal", "target_dtype": "int64", "target_shape": []}
    assert manifest_task(plugin).target_layout(plugin, 7) == (np.dtype("int64"), (7,))
    # a record whose plug-in task no longer imports: its own headline and selection
    ev = {
        "task": "gone",
        "headline": ["x"],
        "selection": {"metric": "val_x", "higher_is_better": False, "label": "x"},
        "provenance": {"config": {"task": "no_such_module_here:make"}},
    }
    recorded = record_task(ev)
    assert recorded.name == "gone" and recorded.epoch_fields() == {"val_x": (int, float)}
