"""Snakemake adapter for rule train: see ddpflow.pipeline.train_run."""

from ddpflow import pipeline
from ddpflow.config import run_by_name
from ddpflow.paths import RunPaths

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
run = run_by_name(smk.config, smk.wildcards.run)
# the files the rule declares, by name (input and output); the rest from ddpflow.paths
files = {**dict(smk.input.items()), **dict(smk.output.items())}
paths = RunPaths.for_rule(smk.config["results_dir"], run, files)
pipeline.run_rule(
    pipeline.train_run,
    smk.log[0],
    run,
    paths,
    smk.config["logs_dir"],
    # a failure is kept in the work folder for the report of the other runs
    failures=(paths.work, "train"),
)
