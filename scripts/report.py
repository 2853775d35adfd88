"""Snakemake adapter for rule report: see ddpflow.pipeline.build_report."""

from pathlib import Path

from ddpflow import pipeline

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(
    pipeline.build_report,
    smk.log[0],
    list(smk.params.runs),
    list(smk.input.train),
    list(smk.input.evaluation),
    str(Path(smk.output.markdown).parent),
)
