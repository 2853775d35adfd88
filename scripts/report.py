"""Snakemake adapter for rule report: see ddpflow.pipeline.build_report, which
`python -m ddpflow report` calls with the same inputs."""

from ddpflow import pipeline

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
pipeline.run_rule(
    pipeline.build_report,
    smk.log[0],
    smk.config["results_dir"],
    # the files read are the rule's declared inputs: results_dir/runs/<run>/...; the
    # bad-node ledger is no declared input: a node failing later must not redo the report
    list(smk.params.runs),
    list(smk.params.sweeps),
)
