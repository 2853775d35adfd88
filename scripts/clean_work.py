"""Snakemake adapter for rule clean_work: see ddpflow.pipeline.clean_work."""

from ddpflow import pipeline

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(pipeline.clean_work, smk.log[0], smk.params.work)
