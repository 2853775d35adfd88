"""Snakemake adapter for rule predict_run: see ddpflow.predict.predict_run."""

from pathlib import Path

from ddpflow import pipeline
from ddpflow.config import run_by_name
from ddpflow.paths import RunPaths
from ddpflow.predict import predict_run

smk = snakemake  # noqa: F821 - injected by Snakemake's script directive
run = run_by_name(smk.config, smk.wildcards.run)
paths = RunPaths.for_rule(smk.config["results_dir"], run, dict(smk.input.items()))
out = {key: str(Path(value).resolve()) for key, value in smk.output.items()}
pipeline.run_rule(
    predict_run, smk.log[0], run, paths, smk.config["logs_dir"], smk.config["predict"], out
)
