"""Snakemake adapter for rule evaluate: see ddpflow.pipeline.evaluate_run."""

from ddpflow import pipeline
from ddpflow.config import run_by_name
from ddpflow.paths import RunPaths

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
run = run_by_name(smk.config, smk.wildcards.run)
# the files the rule declares, by name (input and output); the rest from ddpflow.paths
files = {**dict(smk.input.items()), **dict(smk.output.items())}
pipeline.run_rule(
    pipeline.evaluate_run,
    smk.log[0],
    run,
    RunPaths.for_rule(smk.config["results_dir"], run, files),
    smk.config["logs_dir"],
)
