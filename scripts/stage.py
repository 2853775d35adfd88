"""Snakemake adapter for rule stage: see ddpflow.pipeline.stage_data."""

from ddpflow import pipeline
from ddpflow.report.outcome import staging_work

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(
    pipeline.stage_data,
    smk.log[0],
    dict(smk.params.data),
    smk.output[0],
    smk.threads,
    # a failure is kept for the report: the cause of every run that reads this dataset
    failures=(staging_work(smk.config["results_dir"], smk.wildcards.dataset), "stage"),
)
