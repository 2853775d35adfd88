"""Snakemake adapter for rule report: see ddpflow.pipeline.build_report."""

from pathlib import Path

from ddpflow import pipeline

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(
    pipeline.build_report,
    smk.log[0],
    list(smk.params.runs),
    smk.config["results_dir"],
    str(Path(smk.output.markdown).parent),
)
