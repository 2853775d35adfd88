"""What an evaluation writes and what its rule logs: eval_metrics.json's record (rank 0 of
the training job or of the evaluate job) and the published subset. No torch: the login
node's rules read these too."""

from __future__ import annotations

from ddpflow import runtime
from ddpflow.config import plugin_source, plugin_source_hash


def evaluation_record(run, result, manifest, world_size, hosts, train, evaluated_by) -> dict:
    """eval_metrics.json's content: the counts, what was scored and by whom, the training
    summary and provenance. Refuses a count that is not the whole split."""
    split = run["eval"]["split"]
    record = {
        **result,
        "run": run["name"],
        "split": split,
        "test_size": manifest["sizes"][split],
        "class_names": manifest["class_names"],
        "world_size": world_size,
        "hosts": hosts,
        "evaluated_by": evaluated_by,
        "train": train,
    }
    if record["samples_evaluated"] != record["test_size"]:
        raise RuntimeError(
            f"evaluated {record['samples_evaluated']} samples, the {split} split has "
            f"{record['test_size']}"
        )
    record["provenance"] = {
        **runtime.provenance(),
        "config": run,
        "hostnames": hosts,
        "dataset": {k: manifest[k] for k in ("source", "sizes", "source_notes") if k in manifest},
    }
    if ":" in run["model"]["name"]:  # the plug-in's code, which the config does not hold
        source = plugin_source(run["model"]["name"])
        record["provenance"]["model_plugin"] = {
            "spec": run["model"]["name"],
            "file": str(source) if source else None,
            "sha256": plugin_source_hash(run["model"]["name"]),
        }
    return record


def published(record: dict) -> dict:
    """What the evaluate rule logs of an eval_metrics.json record."""
    keys = ("run", "split", "accuracy", "correct", "samples_evaluated", "test_size")
    return {k: record[k] for k in keys}
