"""Snakemake adapter for rule stage: see ddpflow.pipeline.stage_data."""

from ddpflow import pipeline

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(
    pipeline.stage_data, smk.log[0], dict(smk.params.data), smk.output[0], smk.threads
)
