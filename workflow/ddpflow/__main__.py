"""Command line: the same tasks Snakemake submits, for launchers that start the ranks themselves.

  python -m ddpflow stage    --config config/config.yaml                # once, one process
  srun python -m ddpflow train    --config config/config.yaml --run default
  torchrun --nproc-per-node 2 -m ddpflow evaluate --config config/config.yaml --run default

Every rank runs this module; the rank comes from the launcher's environment
(ddpflow.distenv.discover). scripts/sbatch_train.sh is a ready batch script.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import config as ddpconfig
from . import pipeline
from .data import DataError, verify_staged
from .paths import RunPaths
from .tasks import EvalTask, TrainTask


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ddpflow", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["stage", "train", "evaluate"])
    parser.add_argument("--config", default="config/config.yaml", help="YAML config file")
    parser.add_argument("--run", default=None, help="run name (default: the first run)")
    parser.add_argument(
        "--launcher",
        default=None,
        choices=["local", "slurm"],
        help="override the config's launcher (checks only; ranks come from env)",
    )
    return parser.parse_args(argv)


def select_run(cfg: dict, name: str | None) -> dict:
    runs = ddpconfig.resolve_runs(cfg)
    if name is None:
        return runs[0]
    for run in runs:
        if run["name"] == name:
            return run
    raise ddpconfig.ConfigError(f"--run {name!r}: no such run; runs: {[r['name'] for r in runs]}")


def already_staged(staged: str, data_cfg: dict) -> bool:
    try:
        manifest = verify_staged(staged)
    except DataError:
        return False
    return manifest.get("data_cfg") == data_cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = {"launcher": args.launcher} if args.launcher else {}
    try:
        cfg = ddpconfig.load(args.config, overrides)
        run = select_run(cfg, args.run)
    except ddpconfig.ConfigError as exc:
        print(f"ddpflow: configuration error: {exc}", file=sys.stderr)
        return 2
    paths = RunPaths.for_run(cfg["results_dir"], run)
    if args.command == "stage":
        if already_staged(paths.staged, run["data"]):
            print(f"ddpflow: {paths.staged} is staged and verified; nothing to do")
            return 0
        pipeline.run_rule(pipeline.stage_data, None, run["data"], paths.staged)
        return 0
    task_cls = TrainTask if args.command == "train" else EvalTask
    result = task_cls(run, paths, file_rendezvous=False)()
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
