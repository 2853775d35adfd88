# Validation and helpers shared by every rule file; defines no rules.
import json
import sys

from ddpflow import config as ddpconfig
from ddpflow.slurm_checks import check_runs_against_cluster
from ddpflow.tasks import RunPaths

try:
    # validate (schema + cluster-independent checks) and fill defaults before any job runs
    config.update(ddpconfig.check(config))
except ddpconfig.ConfigError as err:
    sys.exit(f"ddpflow: configuration error: {err}")

RESULTS = config["results_dir"]
LOGS = config["logs_dir"]
RUNS = {run["name"]: run for run in ddpconfig.resolve_runs(config)}

# Against the real cluster too (partition, account, nodes, GPUs, time limit), before anything
# is queued. Only in the main process: jobs re-read this file where sacctmgr may be missing.
if config["launcher"] == "slurm" and workflow.is_main_process:
    try:
        check_runs_against_cluster(list(RUNS.values()))
    except ddpconfig.ConfigError as err:
        sys.exit(f"ddpflow: configuration error: {err}")


wildcard_constraints:
    run="|".join(RUNS),
    dataset="[A-Za-z0-9_]+-[0-9a-f]{10}",


def run_cfg(wildcards):
    return RUNS[wildcards.run]


def run_paths(run_name):
    return RunPaths.for_run(RESULTS, RUNS[run_name])


def local_ranks(wildcards):
    """Cores a train/evaluate job occupies on this machine: all its ranks when local."""
    run = RUNS[wildcards.run]
    return run["world_size"] if run["launcher"] == "local" else 1


def staged_dir(wildcards):
    return f"{RESULTS}/staged/{RUNS[wildcards.run]['dataset_id']}"


def data_cfg_for(dataset):
    for run in RUNS.values():
        if run["dataset_id"] == dataset:
            return run["data"]
    raise ValueError(f"no run uses dataset {dataset}")


def final_outputs():
    """Every run's model and evaluation plus the report: all are targets, so deleting any
    one of them makes a rerun redo exactly it and what depends on it."""
    per_run = [
        f"{RESULTS}/runs/{run}/{name}"
        for run in RUNS
        for name in ("model.pt", "eval_metrics.json")
    ]
    return [*per_run, f"{RESULTS}/report/report.md", f"{RESULTS}/report/report.html"]
