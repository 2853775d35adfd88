"""Snakemake adapter for the export rules: see ddpflow.export.export_run."""

from ddpflow import pipeline
from ddpflow.config import run_by_name
from ddpflow.export import export_run

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
run = run_by_name(smk.config, smk.wildcards.run)
pipeline.run_rule(
    export_run, smk.log[0], run, smk.input.model, smk.input.staged, smk.output[0], smk.params.format
)
