"""Snakemake adapter for rule evaluate: see ddpflow.pipeline.evaluate."""

from ddpflow import pipeline

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(
    pipeline.evaluate,
    smk.log[0],
    dict(smk.params.run),
    smk.config["results_dir"],
    smk.config["logs_dir"],
)
