"""Snakemake adapter for rule train: see ddpflow.pipeline.train."""

from ddpflow import pipeline

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(
    pipeline.train,
    smk.log[0],
    dict(smk.params.run),
    smk.config["results_dir"],
    smk.config["logs_dir"],
)
