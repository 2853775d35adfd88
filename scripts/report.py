"""Snakemake adapter for rule report: see ddpflow.pipeline.build_report."""

from pathlib import Path

from ddpflow import pipeline
from ddpflow.paths import bad_nodes_file

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(
    pipeline.build_report,
    smk.log[0],
    list(smk.params.runs),
    list(smk.input.train),
    list(smk.input.evaluation),
    str(Path(smk.output.markdown).parent),
    # not a declared input: a node failing later must not redo the report of finished runs
    str(bad_nodes_file(smk.config["results_dir"])),
    list(smk.params.sweeps),
)
