"""Snakemake adapter for rule clean_bad_nodes: see ddpflow.pipeline.clean_bad_nodes."""

from ddpflow import pipeline

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(pipeline.clean_bad_nodes, smk.log[0], smk.params.ledger)
