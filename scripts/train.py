"""Snakemake adapter for rule train: see ddpflow.pipeline.train_run."""

from ddpflow import pipeline
from ddpflow.config import run_by_name

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(
    pipeline.train_run,
    smk.log[0],
    run_by_name(smk.config, smk.wildcards.run),
    smk.config["results_dir"],
    smk.config["logs_dir"],
)
