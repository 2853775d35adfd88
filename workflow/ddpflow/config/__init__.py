"""The ddpflow configuration: load it, validate it, resolve its runs, and decide what an edit
redoes. One source of truth for the Snakefile (workflow/rules/common.smk), the scripts and
the tests. Which module does what:

- schema.yaml: every key's type, range, default and description (package data, so a
  non-editable install has it); docs/reference/config.md is generated from it (reference.py).
- schema.py: validation against schema.yaml, filling defaults; coercion of numbers written
  as text and of Slurm times; the one-line error text ("did you mean ..."); ConfigError.
- runs.py: load a config file, check it, resolve its named runs (run_by_name).
- fingerprint.py: what decides a rerun: dataset id and stage params, training and
  evaluation fingerprints, plug-in source hashes, describe_changes.
- machine.py: ranks, world size, memory, gradient accumulation, sharding and memory layout
  of a run; what this machine has (GPUs, bf16 instructions).
- checks.py: combinations the schema cannot refuse, warnings, world size and batch checks,
  trackers whose client is missing (tracking:).
- slurm.py: checks against the real Slurm cluster (imported only with launcher slurm).
- reference.py: renders the configuration reference (python -m ddpflow.config.reference).

Code outside this package imports from here (`from ddpflow import config as ddpconfig`,
`from ddpflow.config import X`); the modules import each other directly, never this file.
"""

from ddpflow.config.checks import (
    _check_run as _check_run,  # tests call it with a resolved run
)
from ddpflow.config.checks import (
    check_batch_fits,
    check_tracking,
    check_world_size,
    run_warnings,
    tracking_enabled,
    warn_what_sits_out,
)
from ddpflow.config.fingerprint import (
    BUILT_IN_MODELS,
    DATA_RUNTIME_KEYS,
    VOLATILE_TRAIN_KEYS,
    as_params,
    config_hash,
    dataset_id,
    describe_changes,
    evaluation_fingerprint,
    flatten,
    on_small,
    own_data_listing,
    plugin_source,
    plugin_source_hash,
    stage_params,
    training_fingerprint,
)
from ddpflow.config.machine import (
    accumulation_steps,
    cpu_computes_bf16,
    local_gpu_count,
    memory_mb,
    micro_batches_per_step,
    ranks_per_node,
    stage_cpus,
    stage_job_resources,
    stage_rule_resources,
    trains_sharded,
    uses_channels_last,
    world_size,
)
from ddpflow.config.runs import (
    SECTIONS,
    check,
    check_runs,
    export_formats,
    load,
    resolve_runs,
    run_by_name,
    run_entries,
    stage_where,
)
from ddpflow.config.schema import ConfigError, load_schema, validate

__all__ = [
    "BUILT_IN_MODELS",
    "DATA_RUNTIME_KEYS",
    "SECTIONS",
    "VOLATILE_TRAIN_KEYS",
    "ConfigError",
    "accumulation_steps",
    "as_params",
    "check",
    "check_batch_fits",
    "warn_what_sits_out",
    "check_tracking",
    "check_runs",
    "check_world_size",
    "config_hash",
    "cpu_computes_bf16",
    "dataset_id",
    "describe_changes",
    "evaluation_fingerprint",
    "flatten",
    "load",
    "load_schema",
    "local_gpu_count",
    "memory_mb",
    "micro_batches_per_step",
    "on_small",
    "own_data_listing",
    "plugin_source",
    "plugin_source_hash",
    "ranks_per_node",
    "stage_cpus",
    "stage_job_resources",
    "stage_rule_resources",
    "stage_where",
    "export_formats",
    "resolve_runs",
    "run_by_name",
    "run_entries",
    "run_warnings",
    "stage_params",
    "trains_sharded",
    "tracking_enabled",
    "training_fingerprint",
    "uses_channels_last",
    "validate",
    "world_size",
]
