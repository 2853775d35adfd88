"""The memory estimate against the ranks' peaks: what ddpflow says a rank will hold before a
run is queued (ddpflow.checks.memory, from ddpflow.training.footprint's fake-tensor
measurement) against the peak resident memory the ranks then record.

One run of the real workflow in a fresh directory (`snakemake --cores 2 --snakefile
<repo>/Snakefile --directory <tmp>`, overhead.py's run, the local launcher at 2 CPU ranks),
whose `runs:` list holds one run per (model, strategy): ddpflow's built-in mlp, cnn and
resnet18 and torchvision's resnet50 and vit_b_16 (model.kwargs image_size 32) x ddp, zero
and fsdp, on synthetic 3x32x32 images (data.source synthetic), 1 epoch, global batch 64 in
micro-batches of 32 (one micro-batch per rank and step), AdamW, fp32, monitoring on (its
defaults: every epoch record's `ranks` list has each rank's peak_rss_mib), tracking off.
The footprint cache (footprints.json) is the work directory's own (XDG_CACHE_HOME), so the
workflow measures every figure and the process's runtime afresh.

Per run, afterwards:

* measured: the largest peak_rss_mib (VmHWM at each epoch's end) over the
  ranks and epochs of results/runs/<run>/train_metrics.jsonl; beside it the largest RSS the
  monitor sampled (results/runs/<run>/system/rank-<r>.jsonl, every 2 s), which also sees
  what comes after the last epoch's record (rank 0's checkpoint write);
* estimate: ddpflow.checks.memory.estimate(run, figures, process, data bytes) as
  ddpflow.checks.early judges the run, with the shape, outputs and data bytes from
  ddpflow.checks.early.input_of(run, the staged manifest) and the figures and process memory from
  ddpflow.checks.early.measure (the workflow's own measurements, read back from its cache: the
  same subprocess and key the parse and the train rule use): its parts, its total (what the
  run is judged by) and the total + the library pages (the process's file-backed RSS: the
  total leaves them out, the node's ranks share them and every rank's RSS counts them in
  full); the train log's own estimate line is kept beside it;
* error = estimate / measured - 1, for both.

Then, to say where a gap comes from, probes in fresh processes (no workflow), resident
memory split into the process's own pages and the libraries' (RssAnon, RssFile): after a
rank's imports, after its first torch.optim optimizer and torchvision, and
footprint.process_memory() itself; and per model one process at world size 1 that builds
the model and optimizer as the training does and trains 3 steps at the run's micro-batch,
after each stage. The allocator matters: run it once more under MALLOC_MMAP_THRESHOLD_=65536
(recorded in the JSON's conditions) to see what glibc keeps of freed memory.

    python bench/memory_estimate.py           # 5 models x 3 strategies (~5 min on 2 cores)
    python bench/memory_estimate.py --quick   # mlp, cnn x ddp, fsdp (~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import overhead
import yaml
from ddpflow import config as ddpconfig
from ddpflow import runtime
from ddpflow.checks import early
from ddpflow.checks import memory as fits
from ddpflow.paths import RUN_FILES, run_dir, staged_dir

REPO = Path(__file__).resolve().parents[1]
MODELS = ("mlp", "cnn", "resnet18", "resnet50", "vit_b_16")
STRATEGIES = ("ddp", "zero", "fsdp")
MODEL_KWARGS = {"vit_b_16": {"image_size": 32}}
GB = 2**30  # as fits counts them (machine.mem_gb)
MIB = 2**20
PARTS = ("parameters", "gradients", "optimizer", "activations", "evaluation", "data", "runtime")
PROBE_TIMEOUT_S = 600

# the imports whose resident memory each side counts: the estimate's runtime is measured in
# the subprocess ddpflow.checks.early starts, after `from ddpflow.training import footprint`; a rank
# unpickles a submitit job holding a ddpflow.training.entry callable
RANK_IMPORTS = (
    "import ddpflow.cluster.jobs, ddpflow.training.entry, submitit, torch.distributed; "
    "from torch.utils.tensorboard import SummaryWriter"
)
# the import probes: what a rank imports; + the first torch.optim optimizer it builds (which
# imports torch._dynamo and sympy); + torchvision (a torchvision model); and the estimate's
# own figure, ddpflow.training.footprint.process_memory() (imports and a tiny model's steps)
IMPORT_PROBES = ("rank", "rank_optimizer", "rank_optimizer_torchvision", "estimate_process")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "memory_estimate.json")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--train-size", type=int, default=256, help="synthetic train_size")
    p.add_argument("--epochs", type=int, default=1, help="train.epochs")
    p.add_argument("--cores", type=int, default=2, help="snakemake --cores")
    p.add_argument("--no-probes", action="store_true", help="skip the RSS probes")
    p.add_argument("--quick", action="store_true", help="mlp and cnn, ddp and fsdp")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="train.deterministic: true (on GPUs: no cuDNN autotuning and its workspaces)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="machine.gpus_per_node (GPU ranks; measured: gpu_peak_alloc_mib, no probes)",
    )
    p.add_argument("--probe", type=json.loads, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.strategies = ["mlp", "cnn"], ["ddp", "fsdp"]
    return args


def run_name(model: str, strategy: str) -> str:
    return f"{model}-{strategy}"


def bench_config(args: argparse.Namespace) -> dict:
    """One run per (model, strategy); everything else shared."""
    synthetic = {
        "channels": 3,
        "height": 32,
        "width": 32,
        "train_size": args.train_size,
        "test_size": 64,
    }
    runs = []
    for model in args.models:
        for strategy in args.strategies:
            spec = {
                "name": model,
                **({"kwargs": MODEL_KWARGS[model]} if model in MODEL_KWARGS else {}),
            }
            runs.append(
                {"name": run_name(model, strategy), "model": spec, "train": {"strategy": strategy}}
            )
    return {
        "data": {"source": "synthetic", "synthetic": synthetic},
        "train": {
            "epochs": args.epochs,
            "global_batch_size": 64,
            "micro_batch_size": 32,
            "progress": False,
            "deterministic": args.deterministic,
            "optimizer": {"name": "adamw", "lr": 0.001},
        },
        "machine": {"nodes": 1, "gpus_per_node": args.gpus, "cpu_ranks_per_node": 2},
        "runs": runs,
    }


# --- after the workflow: measured and estimated, per run ---------------------------------


def measured_peak(folder: Path, key: str = "peak_rss_mib") -> dict:
    """The largest `key` (peak_rss_mib, or gpu_peak_alloc_mib on GPU ranks) of any rank in
    any epoch, and each rank's."""
    path = folder / RUN_FILES["train_metrics"]
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_rank: dict[int, float] = {}
    for record in records:
        for entry in record.get("ranks") or []:
            if key in entry:
                by_rank[entry["rank"]] = max(by_rank.get(entry["rank"], 0.0), entry[key])
    if not by_rank:
        raise RuntimeError(f"{path}: no rank recorded {key}")
    return {
        "peak_bytes": int(max(by_rank.values()) * MIB),
        "per_rank_peak_mib": {str(r): round(v, 1) for r, v in sorted(by_rank.items())},
        "epochs": len(records),
    }


def system_series(folder: Path) -> dict:
    """Each rank's sampled RSS (results/runs/<run>/system/rank-<r>.jsonl): first and max."""
    out = {}
    for path in sorted((folder / "system").glob("rank-*.jsonl")):
        rss = [json.loads(x)["rss_mib"] for x in path.read_text().splitlines() if x.strip()]
        if rss:
            out[path.stem] = {"first_mib": rss[0], "max_mib": max(rss), "samples": len(rss)}
    return out


def log_line(workdir: Path, name: str) -> str | None:
    """The train rule's own estimate line (pipeline._check_memory) in logs/train/<run>.log."""
    path = workdir / "logs" / "train" / f"{name}.log"
    if not path.is_file():
        return None
    lines = [x for x in path.read_text().splitlines() if f"run {name!r}: about" in x]
    return lines[-1].split("ddpflow.pipeline: ", 1)[-1].strip() if lines else None


def estimate_row(workdir: Path, run: dict) -> dict:
    """The estimate the workflow made for run, recomputed from its inputs and its cache."""
    results = workdir / run["results_dir"]
    manifest = json.loads((staged_dir(results, run["dataset_id"]) / "manifest.json").read_text())
    inputs = early.input_of(run, manifest)
    request = early.footprint_request(run, inputs)
    key = early.footprint_key(request)
    cache = workdir / ".snakemake" / "ddpflow" / early.CACHE
    problems, measured = early.measure({}, {key: request}, cache)
    figures = measured.get(key)
    if problems or not figures or "error" in figures:
        raise RuntimeError(f"run {run['name']}: no figures: {problems or figures}")
    process = measured.get(early.RUNTIME) or {"anon": 0, "file": 0}  # as early._judge
    est = fits.estimate(run, figures, process, inputs[2])
    return {
        "figures": figures,
        "process": process,
        "estimate": est,
        "shape": inputs[0],
        "outputs": inputs[1],
    }


def row_for(workdir: Path, run: dict) -> dict:
    folder = run_dir(workdir / run["results_dir"], run["name"])
    gpu = bool(run["machine"]["gpus_per_node"])
    peak = measured_peak(folder, "gpu_peak_alloc_mib" if gpu else "peak_rss_mib")
    got = estimate_row(workdir, run)
    est = got["estimate"]
    # on a GPU torch's allocator counts tensors only: the estimate less its CUDA context
    judged = est.total - est.runtime if gpu else est.total
    # the library pages: in every rank's own RSS in full; Estimate.shared is one rank's share
    # of its node's (counted once per node), in the warning and not in est.total
    shared = got["process"]["file"]
    summary = json.loads((folder / RUN_FILES["train_summary"]).read_text())
    sampled = [r["max_mib"] for r in system_series(folder).values()]
    model, strategy = run["model"]["name"], run["train"]["strategy"]
    return {
        "run": run["name"],
        "model": model,
        "strategy": strategy,
        "world": run["world_size"],
        "micro_batch": run["train"]["micro_batch_size"],
        "precision": run["train"]["precision"],
        "optimizer": run["train"]["optimizer"]["name"],
        "shape": got["shape"],
        "outputs": got["outputs"],
        "estimate_gb": {part: getattr(est, part) / GB for part in PARTS},
        "estimate_total_gb": est.total / GB,
        "estimate_bytes": est.total,
        "estimate_shared_gb": est.shared / GB,
        "library_pages_gb": shared / GB,
        "estimate_rss_gb": (est.total + shared) / GB,
        "measured_peak_gb": peak["peak_bytes"] / GB,
        "measured_peak_bytes": peak["peak_bytes"],
        "per_rank_peak_mib": peak["per_rank_peak_mib"],
        # the RSS the monitor sampled every 2 s, also after the last epoch record was made
        # (rank 0 writes the checkpoint then): None where the run was shorter than a sample
        "sampled_rss_max_gb": max(sampled) * MIB / GB if sampled else None,
        "device": est.device,
        "estimate_tensors_gb": judged / GB,
        "error": judged / peak["peak_bytes"] - 1,
        "error_rss": (est.total + shared) / peak["peak_bytes"] - 1,
        "figures_bytes": got["figures"],
        "process_bytes": got["process"],
        "system_rss_mib": system_series(folder),
        "train_log_estimate": log_line(workdir, run["name"]),
        "steps": summary.get("steps"),
        "train_seconds": summary.get("train_seconds"),
    }


# --- probes: where the resident memory goes, in fresh processes ----------------------------


def resident() -> dict[str, float]:
    """This process's resident memory now, MiB: anonymous (its own), file-backed (the
    libraries' pages, shared by the ranks of a node) and their sum (what ru_maxrss counts)."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            found[key[3:].lower()] = int(value.split()[0]) / 1024
    return {**found, "rss": found["anon"] + found["file"]}


def probe_imports(stage: str) -> dict:
    """In a fresh process: resident memory after the IMPORT_PROBES stage, MiB."""
    if stage == "estimate_process":
        from ddpflow.training import footprint

        process = footprint.process_memory()
        return {**{k: v / MIB for k, v in process.items()}, "rss": sum(process.values()) / MIB}
    exec(RANK_IMPORTS, {})
    if stage.startswith("rank_optimizer"):
        import torch

        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    if stage.endswith("torchvision"):
        import torchvision  # noqa: F401
    return resident()


def probe_rank(cfg: dict) -> dict:
    """In a fresh process (one rank at world size 1: no wrapper, no process group): the
    resident memory after each stage as the training builds it (ddpflow's build_model,
    channels_last where ddpflow uses it, make_optimizer) and after each part of its steps at
    the run's micro-batch, MiB; and the peak (VmHWM) at the end."""
    exec(RANK_IMPORTS, {})
    import torch
    import torch.nn.functional as F
    from ddpflow.training import footprint
    from ddpflow.training.build import make_optimizer
    from ddpflow.training.models import build_model

    torch.set_num_threads(1)
    stages = {"imports": resident()}
    model = build_model(cfg["model"], cfg["shape"], cfg["outputs"])
    if cfg["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    stages["model"] = resident()
    opt = make_optimizer(
        [p for p in model.parameters() if p.requires_grad],
        footprint._optimizer_spec(cfg["optimizer"]),
        0.001,
        torch.device("cpu"),
    )
    stages["optimizer_built"] = resident()
    x = torch.randn(cfg["micro_batch"], *cfg["shape"])
    y = torch.randint(0, cfg["outputs"], (cfg["micro_batch"],))
    for step in range(cfg["steps"]):
        loss = F.cross_entropy(model(x), y)
        stages[f"step{step}_forward"] = resident()
        loss.backward()
        stages[f"step{step}_backward"] = resident()
        opt.step()
        opt.zero_grad(set_to_none=False)
        stages[f"step{step}_optimizer"] = resident()
    peak = runtime.peak_rss_bytes() / 2**20  # VmHWM: ru_maxrss has the launcher's peak
    return {"stages": stages, "peak_rss_mib": peak}


def in_fresh_process(kind: str, cfg) -> dict:
    cmd = [sys.executable, __file__, "--probe", json.dumps({"kind": kind, "cfg": cfg})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    if proc.returncode:
        raise RuntimeError(f"probe {kind} {cfg} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def rounded(value):
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return round(value, 1) if isinstance(value, float) else value


def probe_models(rows: list[dict], runs: dict[str, dict]) -> dict:
    """probe_rank for each model (its first run's settings), each in a fresh process."""
    from ddpflow.config.machine import uses_channels_last

    out = {}
    for row in rows:
        if row["model"] in out:
            continue
        run = runs[row["run"]]
        cfg = {
            "model": run["model"],
            "shape": row["shape"],
            "outputs": row["outputs"],
            "micro_batch": row["micro_batch"],
            "steps": 3,
            "channels_last": uses_channels_last(run),
            "optimizer": dict(run["train"]["optimizer"]),
        }
        out[row["model"]] = rounded(in_fresh_process("rank", cfg))
    return out


def probes(rows: list[dict], runs: dict[str, dict]) -> dict:
    return {
        "imports": {name: rounded(in_fresh_process("imports", name)) for name in IMPORT_PROBES},
        "rank_at_world_1": probe_models(rows, runs),
    }


def run_probe(spec: dict) -> dict:
    if spec["kind"] == "imports":
        return probe_imports(spec["cfg"])
    return probe_rank(spec["cfg"])


# --- the report ----------------------------------------------------------------------


def format_table(report: dict) -> str:
    head = (
        "params",
        "grads",
        "optim",
        "acts",
        "eval",
        "data",
        "runtime",
        "estimate",
        "+shared",
        "measured",
        "sampled",
        "error",
        "+shared",
    )
    lines = [
        "# per rank, GB (2^30 bytes): the estimate's parts and total (ddpflow.checks.memory, as "
        "the run is judged), the total + the library pages it leaves out (+shared: what RSS "
        "shows), the ranks' largest peak_rss_mib, the largest RSS the monitor sampled (every "
        "2 s, also after the epoch's record: rank 0's checkpoint write); error = estimate / "
        "measured - 1",
        f"| {'model':<9} | {'strategy':<8} | " + " | ".join(f"{h:>8}" for h in head) + " |",
    ]
    for r in report["rows"]:
        cells = [r["estimate_gb"][p] for p in PARTS]
        cells += [r["estimate_total_gb"], r["estimate_rss_gb"], r["measured_peak_gb"]]
        sampled = r["sampled_rss_max_gb"]
        lines.append(
            f"| {r['model']:<9} | {r['strategy']:<8} | "
            + " | ".join(f"{c:8.3f}" for c in cells)
            + (f" | {sampled:8.3f}" if sampled is not None else f" | {'-':>8}")
            + f" | {r['error']:+8.1%} | {r['error_rss']:+8.1%} |"
        )
    if probes := report.get("probes"):
        lines.append("# fresh processes, resident MiB (anon + file):")
        for name, m in probes["imports"].items():
            lines.append(f"#   {name}: {m['anon']:.0f} + {m['file']:.0f}")
        for model, got in probes["rank_at_world_1"].items():
            stages = ", ".join(
                f"{k} {v['anon']:.0f}+{v['file']:.0f}" for k, v in got["stages"].items()
            )
            lines.append(f"#   {model} at world 1: {stages}; peak RSS {got['peak_rss_mib']:.0f}")
    return "\n".join(lines)


def source_hashes() -> dict:
    """The estimator's sources this run measured with (they change: say which)."""
    import hashlib

    package = Path(early.__file__).parents[1]
    files = ("checks/early.py", "checks/memory.py", "training/footprint.py")
    return {f: hashlib.sha256((package / f).read_bytes()).hexdigest()[:12] for f in files}


def conditions(args: argparse.Namespace, config: dict, wall: float, sources: dict) -> dict:
    return {
        "workflow": f"one snakemake --cores {args.cores} --snakefile <repo>/Snakefile "
        "--directory <fresh tmp> --configfile <tmp>/config/config.yaml (bench/overhead.py's "
        f"run), all {len(config['runs'])} runs in its runs: list, trained one after another "
        f"(the train rule takes the {args.cores} cores); whole workflow {wall:.0f} s",
        "config": config,
        "launcher": f"local (submitit), {args.gpus} GPU ranks, nccl"
        if args.gpus
        else "local (submitit), 2 CPU ranks, gloo, 1 torch thread per rank",
        "monitoring": "train.monitor defaults (system_interval_s 2, tensorboard on); tracking "
        "off (its default)",
        "measured": "GPU ranks: max over ranks and epochs of gpu_peak_alloc_mib "
        "(torch.cuda.max_memory_allocated: tensors only, compared with the estimate less its "
        "CUDA context)"
        if args.gpus
        else "max over ranks and epochs of peak_rss_mib in train_metrics.jsonl's "
        "`ranks` lists: /proc/self/status VmHWM at each epoch's end (after the "
        "epoch's training and validation), MiB x 2^20; it counts the libraries' "
        "file-backed pages in full in every rank",
        "estimate": "ddpflow.checks.memory.estimate(run, figures, process, data_bytes), as "
        "ddpflow.checks.early._judge makes it: shape, outputs and data bytes from "
        "ddpflow.checks.early.input_of(run, the staged manifest); the figures "
        "(ddpflow.training.footprint.measure on fake tensors) and the process memory "
        "(footprint.process_memory() in ddpflow.checks.early's measuring subprocess) through "
        "ddpflow.checks.early.measure, read back from the footprint cache the workflow wrote "
        "(XDG_CACHE_HOME in the work directory: measured afresh by this workflow). "
        "estimate_total: Estimate.total (what a run is judged by); estimate_rss: total + "
        "the process's file-backed library pages in full (the total leaves them out; the "
        "node's ranks share them, each rank's RSS counts them all)",
        "runtime_source": "ddpflow.checks.early's measuring subprocess (the workflow's own cache), "
        "not a separate python -c",
        "estimator_sources_sha256": sources,
        "estimator_sources_changed_during_run": source_hashes() != sources,
        "error": "estimate_total / measured - 1 (error) and estimate_rss / measured - 1 "
        "(error_rss); negative: the estimate is below the peak",
        "gb": "2^30 bytes",
        "probes": "fresh interpreters, resident memory from /proc/self/status (RssAnon, "
        "RssFile): after a rank's imports; after its first torch.optim optimizer; and "
        "torchvision; footprint.process_memory() itself. Per model one process at world size "
        "1 (no DDP/FSDP wrapper, no process group) building the model (channels_last where "
        "ddpflow uses it) and make_optimizer as the training does, 3 steps of the run's "
        "micro-batch of random images, after each stage",
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "quick": args.quick,
        "loadavg_after": harness.loadavg(),
    }


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    config = bench_config(args)
    configfile = workdir / "config" / "config.yaml"
    configfile.parent.mkdir(parents=True)
    configfile.write_text(yaml.safe_dump(config, sort_keys=False))
    # the workflow's footprint cache: its own, so every figure is measured by this run
    os.environ["XDG_CACHE_HOME"] = str(workdir / "cache")
    sources = source_hashes()
    wall, _ = overhead.snakemake(workdir, configfile, args.cores)
    runs = {run["name"]: run for run in ddpconfig.check_runs(ddpconfig.load(configfile))[1]}
    rows = [row_for(workdir, runs[run_name(m, s)]) for m in args.models for s in args.strategies]
    report = {"rows": rows, "workflow_wall_s": wall}
    if not args.no_probes and not args.gpus:
        report["probes"] = probes(rows, runs)
    report["conditions"] = conditions(args, config, wall, sources)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe is not None:
        print(json.dumps(run_probe(args.probe)))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="ddpflow-memory-estimate-"))
    start = time.perf_counter()
    try:
        report = {
            **harness.head("the memory estimate against the ranks' peaks"),
            **measure(args, workdir),
        }
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - start
    print(format_table(report), flush=True)
    return harness.write(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
