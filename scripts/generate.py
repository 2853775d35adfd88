"""Snakemake adapter for rule generate_run: see ddpflow.generate.generate_run."""

from pathlib import Path

from ddpflow import pipeline
from ddpflow.config import run_by_name
from ddpflow.generate import generate_run
from ddpflow.paths import RunPaths

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
run = run_by_name(smk.config, smk.wildcards.run)
paths = RunPaths.for_rule(smk.config["results_dir"], run, dict(smk.input.items()))
out = {key: str(Path(value).resolve()) for key, value in smk.output.items()}
pipeline.run_rule(
    generate_run, smk.log[0], run, paths, smk.config["logs_dir"], smk.config["generate"], out
)
