"""Snakemake adapter for rule track: see ddpflow.tracking.track.track_run."""

from ddpflow import pipeline
from ddpflow.config import run_by_name
from ddpflow.paths import RunPaths
from ddpflow.tracking.track import track_run

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
run = run_by_name(smk.config, smk.wildcards.run)
paths = RunPaths.for_rule(smk.config["results_dir"], run, dict(smk.input.items()))
pipeline.run_rule(
    track_run,
    smk.log[0],
    run,
    paths,
    smk.config["tracking"],
    smk.output.tracking,
    smk.config["results_dir"],
    smk.log[0],
)
