"""Snakemake adapter for the fetch_weights rule: see ddpflow.config.weights.fetch_all."""

from ddpflow import pipeline
from ddpflow.config.weights import fetch_all

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(fetch_all, smk.log[0], dict(smk.params.entries))
