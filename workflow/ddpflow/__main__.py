"""Command line: the same tasks Snakemake submits, for launchers that start the ranks themselves.

  python -m ddpflow stage                                     # once, one process
  srun python -m ddpflow train default                        # every rank (plain sbatch)
  torchrun --nproc-per-node 2 -m ddpflow evaluate default     # every rank (torchrun)
  python -m ddpflow report                                    # once, after evaluation
  python -m ddpflow plan --configfile F --nodes 128 --gpus-per-node 8   # a shape, simulated

RUN is a run name of the config (default: its first run); --config picks the file
(default config/config.yaml). Write the run as a positional argument under torchrun: torchrun
reads `--run` as an abbreviation of its own --run-path and stops. Every rank runs this module;
the rank comes from the launcher's environment (ddpflow.cluster.distenv.discover).
scripts/sbatch_train.sh is a ready batch script.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddpflow import config as ddpconfig
from ddpflow import pipeline
from ddpflow.data.staged import DataError, verify_staged
from ddpflow.paths import RunPaths
from ddpflow.report.sweep import slim

COMMANDS = {
    "stage": "stage the run's dataset into results/staged (one process; verified, atomic)",
    "train": "train RUN on every rank the launcher started (resumes an interrupted attempt)",
    "evaluate": "evaluate RUN's model on every rank: exact distributed accuracy",
    "report": "build results/report from every run's metrics (one process)",
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ddpflow",
        description=__doc__.split("\n")[0],
        epilog="\n".join(__doc__.split("\n")[1:6]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--config", default="config/config.yaml", help="YAML config file")
        if name != "report":
            sub.add_argument("run_name", nargs="?", metavar="RUN", help="run name")
            sub.add_argument("--run", default=None, help="run name (not under torchrun)")
        sub.add_argument(
            "--launcher",
            default=None,
            choices=["local", "slurm"],
            help="override the config's launcher (checks only; ranks come from env)",
        )
    _add_plan(commands)
    args = parser.parse_args(argv)
    if args.command not in ("report", "plan"):
        if args.run and args.run_name and args.run != args.run_name:
            parser.error(f"two run names: {args.run_name!r} and --run {args.run!r}")
        args.run = args.run or args.run_name
    return args


def _add_plan(commands) -> None:
    help_text = "simulate RUN at a cluster shape in one process: memory, sharding, checkpoint"
    sub = commands.add_parser("plan", help=help_text, description=help_text)
    sub.add_argument("--configfile", default="config/config.yaml", help="YAML config file")
    sub.add_argument("--nodes", type=int, required=True)
    sub.add_argument(
        "--gpus-per-node",
        type=int,
        required=True,
        help="GPU ranks per node (0: CPU ranks, machine.cpu_ranks_per_node)",
    )
    sub.add_argument("--run", default=None, help="run name (default: the config's first)")
    sub.add_argument(
        "--resume-nodes",
        type=int,
        default=None,
        help="the checkpoint's readers at this node count (default: half)",
    )
    sub.add_argument("--json", default=None, metavar="OUT", help="write the plan as JSON")


def _plan(args: argparse.Namespace) -> int:
    """python -m ddpflow plan (ddpflow.plan: imports torch, so only here)."""
    from ddpflow import plan

    if args.nodes < 1 or args.gpus_per_node < 0:
        print("ddpflow: --nodes must be at least 1, --gpus-per-node at least 0", file=sys.stderr)
        return 2
    try:
        doc = plan.plan(
            args.configfile, args.nodes, args.gpus_per_node, args.run, args.resume_nodes
        )
    except ddpconfig.ConfigError as exc:
        print(f"ddpflow: configuration error: {exc}", file=sys.stderr)
        return 2
    print(plan.render(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"ddpflow: plan in {args.json}")
    return 0


def select_run(cfg: dict, name: str | None) -> dict:
    """The run called `name` (default: the config's first), validating that run alone."""
    if name is None:
        name = ddpconfig.run_entries(cfg)[0][0]["name"]
    return ddpconfig.run_by_name(cfg, name)


def already_staged(staged: str, data_cfg: dict) -> bool:
    try:
        manifest = verify_staged(staged)
    except DataError:
        return False
    return manifest.get("data_cfg") == data_cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "plan":
        return _plan(args)
    overrides = {"launcher": args.launcher} if args.launcher else {}
    try:
        cfg = ddpconfig.load(args.config, overrides)
        run = select_run(cfg, getattr(args, "run", None))
    except ddpconfig.ConfigError as exc:
        print(f"ddpflow: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.command == "report":
        return _report(cfg)
    paths = RunPaths.for_run(cfg["results_dir"], run)
    if args.command == "stage":
        if already_staged(paths.staged, run["data"]):
            print(f"ddpflow: {paths.staged} is staged and verified; nothing to do")
            return 0
        pipeline.run_rule(pipeline.stage_data, None, run["data"], paths.staged)
        return 0
    from ddpflow.training.entry import EvalTask, TrainTask  # torch: the ranks' commands only

    task_cls = TrainTask if args.command == "train" else EvalTask
    result = task_cls(run, paths, file_rendezvous=False)()
    print(json.dumps(result, sort_keys=True))
    return 0


def _report(cfg: dict) -> int:
    """The report rule's report (pipeline.build_report, with the inputs workflow/rules/report.smk
    passes), of every run of the config."""
    runs = ddpconfig.resolve_runs(cfg)
    names, sweeps = [run["name"] for run in runs], [slim(run.get("sweep")) for run in runs]
    paths = pipeline.run_rule(pipeline.build_report, None, cfg["results_dir"], names, sweeps)
    print(f"ddpflow: report in {paths['html']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
