"""Data loading: ddpflow's staged, streamed feed vs the tutorials' ImageFolder + DataLoader.

On an image folder that Pillow writes into a temporary directory (--images PNG files of
--classes classes, each --sizes pixels square, stored at that size), three measurements:

1. Loader throughput: images/s delivered to the training step of ONE rank (rank 0 of a
   2-rank job: its micro-batches, or its DistributedSampler shard), batch --batch per rank
   (ddpflow: the micro-batch, global batch 2 x --batch), --workers worker processes for
   both loaders, each batch normalised to float as the step does
   (ddpflow.training.evaluate.normalize with the staged train mean/std, the same for every
   path) and its labels taken:

   * ``streamed``: ddpflow's streamed path: the folder staged once (not timed) with
     ``ddpflow.data.staging.stage_dataset``, then ``ddpflow.data.feed.StreamFeed`` over
     ``open_split(...)[0]`` (the train split), batches as Loop takes them
     (``ddpflow.training.schedule.step_micro_batches`` + ``rank_micro_batches``: one shuffle cut
     into steps of the global batch, this rank's micro-batch of each; the remainder of n
     sits the epoch out), labels by index_select (ddpflow keeps them in memory);
   * ``tutorial``: ``torchvision.datasets.ImageFolder(root/train, transform=Compose([Resize,
     CenterCrop, PILToTensor]))`` + ``DistributedSampler(num_replicas=2, rank=0,
     shuffle=True, seed=0)`` + ``DataLoader(batch_size, num_workers, pin_memory=False)``,
     ``sampler.set_epoch`` each epoch;
   * ``in_memory`` (reference): ddpflow's in-memory path, the whole split loaded once (not
     timed) and one index_select per batch (``ddpflow.data.feed.MemoryFeed``).

   Each loader is built once and iterated epoch after epoch as training does (the tutorial's
   DataLoader starts its workers every epoch; StreamFeed's persist). After one untimed epoch
   each, --repeats epochs each, the paths alternating (order rotated every repeat); an
   epoch's time runs from asking for the epoch's iterator to the last batch consumed.

2. Peak resident memory of a rank on the streamed path when its train split is 4x
   --memory-budget-gb (data.loading.memory_budget_gb; GiB), against the in-memory path as
   the baseline: random 3x64x64 uint8 images staged from an npz file; each path runs one
   epoch of uint8 batches in a fresh process (so its RSS is its own), --workers workers for
   streamed. The rank's peak is its VmHWM; "constant" is its VmRSS right after importing
   torch and ddpflow; it fits if peak <= budget + constant. The driver also samples the rank
   and its worker processes every --sample-ms (/proc/<pid>/smaps_rollup: RSS, and the PSS of
   anonymous and shared-memory pages, which counts the pages the forked workers share with
   the rank once).

3. Staging throughput: stage_dataset of the image folder with threads 1 and 2, each into a
   fresh directory (decode, shard writing, fsync and sha256 included).

    python bench/data.py                 # 20,000 images, 32x32 and 64x64, 3 repeats
    python bench/data.py --quick         # 2,000 images, budget 0.01 GiB, 2 repeats
    python bench/data.py --quick --images 300 --sizes 16 --repeats 1      # the smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harness
import numpy as np
import torch
from ddpflow import config as ddpconfig
from ddpflow.data import feed
from ddpflow.data.staged import choose_in_memory, open_split, read_manifest
from ddpflow.data.staging import stage_dataset
from ddpflow.training.evaluate import normalize
from ddpflow.training.schedule import rank_micro_batches, step_micro_batches

WORLD, RANK, SEED = 2, 0, 0  # one rank of a 2-rank job, the sampler's seed
TARGET = 5.0  # streamed vs the tutorial loader, images/s (the issue)
MEMORY_SHAPE = (3, 64, 64)
MB = 1e6
WORKER_TIMEOUT_S = 1800


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "data.json", worker=True)
    p.add_argument(
        "--images", type=int, default=None, help="images in the folder (20000; --quick 2000)"
    )
    p.add_argument("--sizes", type=int, nargs="+", default=[32, 64], help="square image sizes")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--batch", type=int, default=256, help="images per batch (per rank)")
    p.add_argument("--workers", type=int, default=2, help="loader worker processes, both paths")
    p.add_argument("--prefetch", type=int, default=4, help="StreamFeed batches ahead per worker")
    p.add_argument("--repeats", type=int, default=None, help="timed epochs per path (3; --quick 2)")
    p.add_argument("--stage-threads", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="data.loading."
        "memory_budget_gb of the memory case, GiB (0.05; --quick 0.01; 0: skip it)",
    )
    p.add_argument("--sample-ms", type=float, default=10.0, help="memory sampling interval")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the rank")
    p.add_argument("--quick", action="store_true", help="2,000 images, smaller memory case")
    p.add_argument("--tmp", type=Path, default=None, help="where the image folders go")
    p.add_argument("--stage-worker", type=json.loads, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.images is None:
        args.images = 2000 if args.quick else 20000
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.memory_budget_gb is None:
        args.memory_budget_gb = 0.01 if args.quick else 0.05
    return args


def data_cfg(overrides: dict) -> dict:
    """The config's data section, schema defaults filled."""
    return ddpconfig.load(None, {"data": overrides})["data"]


# --- the image folder ----------------------------------------------------------------


def write_folder(root: Path, count: int, size: int, classes: int, seed: int = 0) -> float:
    """root/train/class_k/img_NNNNNN.png: count RGB PNGs of size x size, class k a colour
    plus noise (round robin over the classes); returns the seconds it took."""
    from PIL import Image

    began = time.perf_counter()
    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, (classes, 1, 1, 3))
    for k in range(classes):
        (root / "train" / f"class_{k}").mkdir(parents=True, exist_ok=True)

    def write(start: int) -> None:
        local = np.random.default_rng([seed, start])
        stop = min(start + 500, count)
        noise = local.integers(-48, 49, (stop - start, size, size, 3))
        for i in range(start, stop):
            k = i % classes
            pixels = np.clip(colours[k] + noise[i - start], 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / "train" / f"class_{k}" / f"img_{i:06d}.png")

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # Pillow encodes without the GIL
        list(pool.map(write, range(0, count, 500)))
    return time.perf_counter() - began


def folder_cfg(root: Path, size: int) -> dict:
    return data_cfg(
        {"source": "image_folder", "root": str(root), "image_size": [size, size], "channels": 3}
    )


# --- 3. staging ------------------------------------------------------------------------


def staging(root: Path, size: int, threads: list[int], work: Path) -> tuple[list[dict], Path]:
    """stage_dataset of the folder once per thread count, each into a fresh directory; the
    rows and the directory of the last (kept for the loader case)."""
    cfg, rows, digests, staged = folder_cfg(root, size), [], [], None
    for t in threads:
        staged = work / f"staged-{size}-t{t}"
        shutil.rmtree(staged, ignore_errors=True)
        began = time.perf_counter()
        manifest = stage_dataset(cfg, staged, SEED, threads=t)
        seconds = time.perf_counter() - began
        images = sum(manifest["sizes"].values())
        digests.append({k: v["sha256"] for k, v in manifest["files"].items()})
        rows.append(
            {
                "size": size,
                "threads": t,
                "images": images,
                "seconds": seconds,
                "images_per_s": images / seconds,
                "staged_bytes": sum(v["bytes"] for v in manifest["files"].values()),
                "splits": manifest["sizes"],
            }
        )
        print(
            f"  staged {images} images of {size}x{size} with {t} thread(s) in {seconds:.2f} s",
            flush=True,
        )
    for row in rows:  # staging is deterministic whatever the thread count
        row["same_bytes_as_first"] = digests[rows.index(row)] == digests[0]
    return rows, staged


# --- 1. loader throughput -------------------------------------------------------------


class Streamed:
    """ddpflow's streamed path, as Loop.train_epoch drives it."""

    def __init__(self, staged: Path, workers: int, prefetch: int, batch: int):
        self.images, labels, manifest = open_split(staged, "train")
        self.labels = torch.from_numpy(labels)
        self.norm = norm_of(manifest)
        self.feed = feed.StreamFeed(self.images, "cpu", workers, prefetch)
        self.batch = batch

    def epoch(self, epoch: int, normalise: bool = True) -> int:
        batches = rank_batches(len(self.images), self.batch, epoch)
        done = 0
        for index, x in enumerate(self.feed.epoch(batches, 0)):
            x = normalize(x, *self.norm) if normalise else x
            y = self.labels.index_select(0, batches[index])
            done += consume(x, y)
        return done

    def close(self) -> None:
        self.feed.close()
        self.images.close()


def rank_batches(n: int, batch: int, epoch: int) -> torch.Tensor:
    """Rank RANK's micro-batches of the epoch, [steps, batch], as Loop takes them: global
    batch WORLD x batch, one micro-batch per rank and step (no accumulation)."""
    steps = step_micro_batches(n, WORLD * batch, batch, SEED, epoch)
    return rank_micro_batches(steps, WORLD, RANK)


def rank_images(n: int, batch: int) -> int:
    """Images rank RANK reads in an epoch of rank_batches: batch per full global step."""
    return n // (WORLD * batch) * batch


class InMemory(Streamed):
    """ddpflow's in-memory path: the split in one tensor, a batch one index_select."""

    def __init__(self, staged: Path, workers: int, prefetch: int, batch: int):
        images, labels, manifest = open_split(staged, "train")
        began = time.perf_counter()
        self.images = torch.from_numpy(images.load())
        self.load_seconds = time.perf_counter() - began
        images.close()
        self.labels = torch.from_numpy(labels)
        self.norm = norm_of(manifest)
        self.feed = feed.MemoryFeed(self.images)
        self.batch = batch

    def close(self) -> None:
        self.feed.close()


class Tutorial:
    """The PyTorch DDP tutorials' way: ImageFolder + DistributedSampler + DataLoader."""

    def __init__(self, root: Path, size: int, workers: int, batch: int, norm):
        from torch.utils.data import DataLoader, DistributedSampler
        from torchvision import datasets, transforms

        transform = transforms.Compose(
            [transforms.Resize(size), transforms.CenterCrop(size), transforms.PILToTensor()]
        )
        self.dataset = datasets.ImageFolder(str(root / "train"), transform=transform)
        self.sampler = DistributedSampler(
            self.dataset, num_replicas=WORLD, rank=RANK, shuffle=True, seed=SEED
        )
        self.loader = DataLoader(
            self.dataset,
            batch_size=batch,
            sampler=self.sampler,
            num_workers=workers,
            pin_memory=False,
        )
        self.norm = norm

    def epoch(self, epoch: int) -> int:
        self.sampler.set_epoch(epoch)
        done = 0
        for x, y in self.loader:
            done += consume(normalize(x, *self.norm), y)
        return done

    def close(self) -> None:
        self.loader = None


def norm_of(manifest: dict) -> tuple[torch.Tensor, torch.Tensor]:
    shape = [1, len(manifest["mean"]), 1, 1]
    return (torch.tensor(manifest["mean"]).view(shape), torch.tensor(manifest["std"]).view(shape))


def consume(x: torch.Tensor, y: torch.Tensor) -> int:
    """What the step gets: a float batch and its labels (checked, so nothing is skipped)."""
    if x.dtype not in (torch.float32, torch.uint8) or x.shape[0] != y.shape[0]:
        raise RuntimeError(f"unexpected batch {x.dtype}{list(x.shape)}, labels {list(y.shape)}")
    return int(x.shape[0])


def loader_case(root: Path, staged: Path, size: int, args: argparse.Namespace) -> dict:
    """One image size: every path's images/s over --repeats epochs, after one untimed."""
    manifest = read_manifest(staged)
    paths = {
        "streamed": Streamed(staged, args.workers, args.prefetch, args.batch),
        "tutorial": Tutorial(root, size, args.workers, args.batch, norm_of(manifest)),
        "in_memory": InMemory(staged, args.workers, args.prefetch, args.batch),
    }
    ours = rank_images(manifest["sizes"]["train"], args.batch)
    if ours == 0:
        raise SystemExit(
            f"the train split ({manifest['sizes']['train']} images) is smaller "
            f"than one global batch ({WORLD} x --batch {args.batch})"
        )
    expected = {"streamed": ours, "tutorial": len(paths["tutorial"].sampler), "in_memory": ours}
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    first: dict[str, float] = {}
    names = list(paths)
    try:
        for repeat in range(-1, args.repeats):  # -1: the untimed first epoch
            shift = max(repeat, 0) % len(names)
            for name in names[shift:] + names[:shift]:
                began = time.perf_counter()
                done = paths[name].epoch(repeat + 1)
                elapsed = time.perf_counter() - began
                if done != expected[name]:
                    raise RuntimeError(
                        f"{name}: {done} images in an epoch, {expected[name]} expected"
                    )
                if repeat < 0:
                    first[name] = elapsed
                else:
                    seconds[name].append(elapsed)
    finally:
        for path in paths.values():
            path.close()
    row = {
        "size": size,
        "image_shape": manifest["shape"],
        "batch": args.batch,
        "workers": args.workers,
        "paths": {},
    }
    for name in names:
        rates = [expected[name] / s for s in seconds[name]]
        row["paths"][name] = {
            "images_per_epoch": expected[name],
            "batches_per_epoch": math.ceil(expected[name] / args.batch),
            "images_per_s": statistics.median(rates),
            "all_images_per_s": rates,
            "all_seconds": seconds[name],
            "first_epoch_s": first[name],
        }
    row["paths"]["in_memory"]["load_seconds"] = paths["in_memory"].load_seconds
    p = row["paths"]
    row["streamed_over_tutorial"] = p["streamed"]["images_per_s"] / p["tutorial"]["images_per_s"]
    row["in_memory_over_streamed"] = p["in_memory"]["images_per_s"] / p["streamed"]["images_per_s"]
    row["meets_target"] = row["streamed_over_tutorial"] >= TARGET
    row["loadavg_after"] = harness.loadavg()
    return row


# --- 2. memory: a fresh rank process per path -----------------------------------------


def stage_memory_worker(cfg: dict) -> int:
    """In a fresh process: stage the folder (1 process), report the peak against the
    resident size right after the imports."""
    constant = status_bytes(os.getpid(), "VmRSS")
    began = time.perf_counter()
    manifest = stage_dataset(
        folder_cfg(Path(cfg["root"]), cfg["size"]),
        Path(cfg["out"]),
        SEED,
        threads=1,
        shard_bytes=cfg["shard_bytes"],
    )
    result = {
        "images": sum(manifest["sizes"].values()),
        "staged_bytes": sum(v["bytes"] for v in manifest["files"].values()),
        "shards": sum(len(v) for v in manifest["shards"].values()),
        "seconds": time.perf_counter() - began,
        "shard_bytes": cfg["shard_bytes"],
        "constant_rss_bytes": constant,
        "peak_rss_bytes": status_bytes(os.getpid(), "VmHWM"),
    }
    result["peak_above_constant_bytes"] = result["peak_rss_bytes"] - constant
    Path(cfg["result_file"]).write_text(json.dumps(result))
    return 0


# shards of the staging-memory case: small enough that a quarter of the folder already
# fills several (with the default 64 MiB, a quarter of 20,000 64x64 images fills none)
STAGE_MEMORY_SHARD = 8 << 20


def staging_memory(root: Path, size: int, work: Path) -> list[dict]:
    """Peak resident memory of staging a quarter of the folder and all of it, in shards of
    STAGE_MEMORY_SHARD: bounded by a shard or two, it must not grow with the images."""
    quarter = work / f"folder-{size}-quarter"
    for folder in sorted((root / "train").iterdir()):
        files = sorted(folder.iterdir())
        (quarter / "train" / folder.name).mkdir(parents=True)
        for path in files[: len(files) // 4]:
            os.link(path, quarter / "train" / folder.name / path.name)
    rows = []
    for label, folder in (("quarter", quarter), ("all", root)):
        result_file = work / f"stage-memory-{label}.json"
        wcfg = {
            "root": str(folder),
            "size": size,
            "out": str(work / f"staged-mem-{label}"),
            "result_file": str(result_file),
            "shard_bytes": STAGE_MEMORY_SHARD,
        }
        subprocess.run([sys.executable, __file__, "--stage-worker", json.dumps(wcfg)], check=True)
        rows.append({"size": size, "folder": label, **json.loads(result_file.read_text())})
        shutil.rmtree(work / f"staged-mem-{label}")
        print(
            f"  staging memory ({label}): peak {rows[-1]['peak_above_constant_bytes'] / 1e6:.0f}"
            f" MB above the imports for {rows[-1]['images']} images",
            flush=True,
        )
    shutil.rmtree(quarter)
    return rows


def memory_worker(cfg: dict) -> int:
    """In a fresh process: the constant, then one epoch of one path, then the peaks."""
    torch.set_num_threads(cfg["threads"])
    constant = status_bytes(os.getpid(), "VmRSS")  # torch + ddpflow imported, nothing else
    constant_data_pss = private_pss(os.getpid())
    staged = Path(cfg["staged"])
    run = {"data": {"loading": {"in_memory": "auto", "memory_budget_gb": cfg["budget_gb"]}}}
    images, labels, manifest = open_split(staged, "train")
    auto_in_memory, why = choose_in_memory(run, images.nbytes)
    nbytes = images.nbytes
    began = time.perf_counter()
    if cfg["path"] == "streamed":
        path = Streamed(staged, cfg["workers"], cfg["prefetch"], cfg["batch"])
    else:
        path = InMemory(staged, 0, 1, cfg["batch"])
    images.close()
    done = path.epoch(0, normalise=False)  # uint8 batches: the data path's memory alone
    seconds = time.perf_counter() - began
    workers = {}  # the persistent workers are still alive: their own peaks
    for child in children(os.getpid()):
        workers[child] = status_bytes(child, "VmHWM")
    result = {
        "path": cfg["path"],
        "pid": os.getpid(),
        "constant_rss_bytes": constant,
        "constant_data_pss_bytes": constant_data_pss,
        "peak_rss_bytes": status_bytes(os.getpid(), "VmHWM"),
        "rss_after_bytes": status_bytes(os.getpid(), "VmRSS"),
        "worker_peak_rss_bytes": list(workers.values()),
        "split_bytes": nbytes,
        "split_images": len(labels),
        "images_read": done,
        "epoch_seconds": seconds,
        "auto_in_memory": auto_in_memory,
        "auto_why": why,
        "image_shape": manifest["shape"],
    }
    path.close()
    Path(cfg["result_file"]).write_text(json.dumps(result))
    return 0


def status_bytes(pid: int, key: str) -> int:
    """A /proc/<pid>/status figure (VmRSS, VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def rollup(pid: int) -> dict[str, int]:
    """/proc/<pid>/smaps_rollup in bytes (Rss, Pss, Pss_Anon, Pss_Shmem, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def private_pss(pid: int) -> int:
    """The PSS of a process's anonymous and shared-memory pages: its data. File pages (code,
    libraries) are left out: unrelated processes mapping the same libraries (another torch
    process on the machine) change their PSS share while the data stays put."""
    info = rollup(pid)
    return info["Pss_Anon"] + info["Pss_Shmem"]


def children(pid: int) -> list[int]:
    """pid's child processes (any of its threads' children), then theirs."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread ended
            continue
    return found + [g for c in found for g in children(c)]


def sample_tree(proc: subprocess.Popen, interval: float) -> dict:
    """Until proc exits: the largest simultaneous sums over proc and its children of RSS
    and of the anonymous + shared-memory PSS (pages shared with the forked workers counted
    once), from /proc/<pid>/smaps_rollup."""
    top = {"rss": 0, "data_pss": 0, "processes": 0, "samples": 0, "failed_samples": 0}
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            family = [proc.pid, *children(proc.pid)]
            infos = [rollup(pid) for pid in family]
        except (OSError, ValueError, KeyError):  # a process came or went while read
            top["failed_samples"] += 1
        else:
            top["samples"] += 1
            top["processes"] = max(top["processes"], len(family))
            top["rss"] = max(top["rss"], sum(i["Rss"] for i in infos))
            data = sum(i["Pss_Anon"] + i["Pss_Shmem"] for i in infos)
            top["data_pss"] = max(top["data_pss"], data)
        time.sleep(interval)
    proc.wait(timeout=max(deadline - time.monotonic(), 1))
    return top


def memory_case(work: Path, args: argparse.Namespace) -> dict:
    """Stage a train split of 4x the budget (npz of random images), then each path's rank."""
    budget = int(args.memory_budget_gb * 2**30)  # feed.budget_bytes: GiB
    per_image = int(np.prod(MEMORY_SHAPE))
    want = math.ceil(4 * budget / per_image)  # train images
    cfg = data_cfg({"source": "npz", "path": str(work / "memory.npz")})
    total = math.ceil(want / (1 - cfg["val_fraction"]))
    while total - round(cfg["val_fraction"] * total) < want:
        total += 1
    rng = np.random.default_rng(SEED)
    test = max(10, total // 10)
    np.savez(
        work / "memory.npz",
        train_images=rng.integers(0, 256, (total, *MEMORY_SHAPE), dtype=np.uint8),
        train_labels=np.arange(total) % 10,
        test_images=rng.integers(0, 256, (test, *MEMORY_SHAPE), dtype=np.uint8),
        test_labels=np.arange(test) % 10,
    )
    staged = work / "staged-memory"
    began = time.perf_counter()
    manifest = stage_dataset(cfg, staged, SEED, threads=1)
    stage_seconds = time.perf_counter() - began
    (work / "memory.npz").unlink()
    rows = []
    for path in ("streamed", "in_memory"):
        print(f"  memory: {path} rank ...", flush=True)
        result_file = work / f"memory-{path}.json"
        wcfg = {
            "path": path,
            "staged": str(staged),
            "budget_gb": args.memory_budget_gb,
            "workers": args.workers,
            "prefetch": args.prefetch,
            "batch": args.batch,
            "threads": args.threads,
            "result_file": str(result_file),
        }
        proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(wcfg)])
        sampled = sample_tree(proc, args.sample_ms / 1000)
        if proc.returncode:
            raise RuntimeError(f"memory worker {path} failed with exit code {proc.returncode}")
        r = json.loads(result_file.read_text())
        constant = r["constant_rss_bytes"]
        r["sampled"] = sampled
        r["peak_above_constant_bytes"] = r["peak_rss_bytes"] - constant
        r["fits_budget"] = r["peak_rss_bytes"] <= budget + constant
        r["workers_peak_sum_bytes"] = sum(r["worker_peak_rss_bytes"])
        r["tree_data_pss_above_constant_bytes"] = sampled["data_pss"] - r["constant_data_pss_bytes"]
        r["tree_fits_budget"] = r["tree_data_pss_above_constant_bytes"] <= budget
        rows.append(r)
    return {
        "budget_gb": args.memory_budget_gb,
        "budget_bytes": budget,
        "image_shape": list(MEMORY_SHAPE),
        "train_images": manifest["sizes"]["train"],
        "train_bytes": manifest["sizes"]["train"] * per_image,
        "train_over_budget": manifest["sizes"]["train"] * per_image / budget,
        "staged_bytes": sum(v["bytes"] for v in manifest["files"].values()),
        "stage_seconds": stage_seconds,
        # streamed: batches read ahead, held by the workers (shared memory) until consumed
        "read_ahead_bytes": args.workers * args.prefetch * args.batch * per_image,
        "runs": rows,
    }


# --- report ---------------------------------------------------------------------------


def format_table(report: dict) -> str:
    c = report["conditions"]
    lines = [
        f"# loader throughput: rank {RANK} of {WORLD}, batch {c['batch']}, {c['workers']} "
        f"workers, normalised float batch + labels; median of {c['repeats']} epochs after 1",
        "| size | path | images/epoch | images/s (median) | all | first epoch s |",
        "|--:|---|--:|--:|---|--:|",
    ]
    for row in report["loader"]:
        for name, p in row["paths"].items():
            every = ", ".join(f"{v:.0f}" for v in p["all_images_per_s"])
            lines.append(
                f"| {row['size']} | {name} | {p['images_per_epoch']} | "
                f"{p['images_per_s']:.0f} | {every} | {p['first_epoch_s']:.2f} |"
            )
    for row in report["loader"]:
        verdict = "meets" if row["meets_target"] else "MISSES"
        lines.append(
            f"{row['size']}x{row['size']}: streamed / tutorial "
            f"{row['streamed_over_tutorial']:.1f}x ({verdict} target {TARGET:.0f}x); "
            f"in_memory / streamed {row['in_memory_over_streamed']:.1f}x"
        )
    if mem := report.get("memory"):
        lines += [
            "",
            f"# peak RSS of one rank, one epoch; train split {mem['train_images']} images "
            f"{mem['image_shape']} = {mem['train_bytes'] / MB:.1f} MB = "
            f"{mem['train_over_budget']:.2f}x the budget {mem['budget_gb']} GiB "
            f"({mem['budget_bytes'] / MB:.1f} MB); streamed reads ahead workers x prefetch x "
            f"batch = {mem['read_ahead_bytes'] / MB:.1f} MB; MB = 10^6 bytes",
            "| path | constant MB | rank peak MB | peak - constant MB | <= budget? | "
            "workers' peaks MB | rank+workers data PSS - constant MB | <= budget? |",
            "|---|--:|--:|--:|---|---|--:|---|",
        ]
        for r in mem["runs"]:
            workers = ", ".join(f"{w / MB:.0f}" for w in r["worker_peak_rss_bytes"]) or "-"
            tree = r["tree_data_pss_above_constant_bytes"]
            lines.append(
                f"| {r['path']} | {r['constant_rss_bytes'] / MB:.0f} | "
                f"{r['peak_rss_bytes'] / MB:.0f} | {r['peak_above_constant_bytes'] / MB:.1f} | "
                f"{'yes' if r['fits_budget'] else 'NO'} | {workers} | {tree / MB:.1f} | "
                f"{'yes' if r['tree_fits_budget'] else 'NO'} |"
            )
    lines += [
        "",
        "# staging the image folder (decode, shards, fsync, sha256)",
        "| size | threads | images | seconds | images/s | same bytes |",
        "|--:|--:|--:|--:|--:|---|",
    ]
    for r in report["staging"]:
        lines.append(
            f"| {r['size']} | {r['threads']} | {r['images']} | {r['seconds']:.2f} | "
            f"{r['images_per_s']:.0f} | {r['same_bytes_as_first']} |"
        )
    if report.get("staging_memory"):
        lines += [
            "",
            "# peak resident memory of staging (1 process, 8 MiB shards), above the imports; "
            "MB = 10^6 bytes",
            "| size | folder | images | staged MB | shards | peak above imports MB |",
            "|--:|---|--:|--:|--:|--:|",
        ]
        for r in report["staging_memory"]:
            lines.append(
                f"| {r['size']} | {r['folder']} | {r['images']} | "
                f"{r['staged_bytes'] / 1e6:.0f} | {r['shards']} | "
                f"{r['peak_above_constant_bytes'] / 1e6:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return memory_worker(args.worker)
    if args.stage_worker is not None:
        return stage_memory_worker(args.stage_worker)
    torch.set_num_threads(args.threads)
    import PIL
    import torchvision

    report = {
        **harness.head(
            "data loading: ddpflow's streamed feed vs ImageFolder + DataLoader; "
            "peak RSS of a streamed rank against the memory budget; staging throughput"
        ),
        "conditions": {
            "device": "cpu",
            "images": args.images,
            "classes": args.classes,
            "sizes": args.sizes,
            "folder": "RGB PNGs written by Pillow at the benchmark's size (class colour + "
            "uniform noise of +-48), root/train/class_k/; no test/ folder, so staging carves "
            "test (data.test_fraction) and val (data.val_fraction) out of it: the staged "
            "train split is 72 % of the images, the tutorial's ImageFolder(root/train) all of "
            "them (images/s compares the two)",
            "resize": "images are stored at the target size: the tutorial's Resize and "
            "CenterCrop (and ddpflow's staging resize) change no pixel (decode + convert "
            "only): the cheapest case for the tutorial loader",
            "rank": f"rank {RANK} of a {WORLD}-rank job, seed {SEED}: ddpflow's paths take "
            f"its micro-batches (global batch {WORLD} x batch, one shuffle cut into steps, "
            "the remainder left out: fewer images per epoch than the tutorial's); the "
            "tutorial its DistributedSampler shard (shuffle, padded); images/s compares them",
            "batch": args.batch,
            "workers": args.workers,
            "prefetch": args.prefetch,
            "streamed": "ddpflow.data.feed.StreamFeed(open_split(staged, 'train')[0], cpu, "
            "workers, "
            "prefetch) built once, .epoch(rank_micro_batches(step_micro_batches(n, 2 x "
            "batch, batch, seed, epoch), 2, 0), 0) per epoch "
            "(persistent workers, one pread per image); labels by index_select",
            "tutorial": "torchvision.datasets.ImageFolder(root/train, Compose([Resize(size), "
            "CenterCrop(size), PILToTensor()])) + DistributedSampler(num_replicas=2, rank=0, "
            "shuffle=True, seed=0) + DataLoader(batch, num_workers=workers, "
            "pin_memory=False), built once, set_epoch + a fresh iterator per epoch (workers "
            "started every epoch, as the tutorials do)",
            "in_memory": "ddpflow.data.feed.MemoryFeed over the split loaded whole "
            "(load not timed; "
            "its seconds reported): one index_select per batch",
            "step": "each batch: ddpflow.training.evaluate.normalize(x, train mean, train std) "
            "(float), "
            "labels taken; no model",
            "timing": "per path: one untimed epoch (page cache, persistent workers), then "
            "--repeats epochs, paths alternating with the order rotated every repeat; an "
            "epoch from asking for its iterator to the last batch consumed; median of them",
            "repeats": args.repeats,
            "threads": f"torch threads of the rank (main process): {args.threads}; DataLoader "
            "workers run 1 each",
            "cores": f"{os.cpu_count()} cores: the {args.workers} worker processes compete "
            "with the rank's main process for them (and with anything else running: see "
            "loadavg)",
            "memory": "a fresh process per path (python bench/data.py --worker), one epoch of "
            "uint8 batches + labels, not normalised: the step's float copy of a batch "
            "(batch x C x H x W x 4 bytes and its temporaries) is the same on both paths and "
            "not the data's; constant = VmRSS right after import torch + ddpflow (+ this "
            "script's imports: numpy, json); rank peak = VmHWM at the end of the epoch; fits: "
            "rank peak <= budget + constant; workers' peaks = their VmHWM before they end "
            "(forked: they count the rank's pages they share); rank+workers data PSS = largest "
            "sampled sum over the rank and its workers of anonymous + shared-memory PSS "
            "(/proc/<pid>/smaps_rollup Pss_Anon + Pss_Shmem: pages the forked workers share "
            "with the rank counted once; file pages, i.e. code, left out) minus the rank's at "
            "the constant; also the largest sampled sum of RSS; every --sample-ms",
            "memory_budget_gb": args.memory_budget_gb,
            "stage_threads": args.stage_threads,
            "pillow": PIL.__version__,
            "torchvision": torchvision.__version__,
            "loadavg_at_start": harness.loadavg(),
            "quick": args.quick,
        },
    }
    start = time.perf_counter()
    tmp_parent = str(args.tmp) if args.tmp else None
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-data-", dir=tmp_parent) as tmp:
        work = Path(tmp)
        report["loader"], report["staging"], report["folders"] = [], [], []
        for size in args.sizes:
            root = work / f"folder-{size}"
            seconds = write_folder(root, args.images, size, args.classes)
            report["folders"].append(
                {"size": size, "images": args.images, "write_seconds": seconds}
            )
            print(f"size {size}: wrote {args.images} PNGs in {seconds:.1f} s", flush=True)
            rows, staged = staging(root, size, args.stage_threads, work)
            report["staging"] += rows
            print(f"  loaders ({args.repeats} repeats) ...", flush=True)
            report["loader"].append(loader_case(root, staged, size, args))
            if size == max(args.sizes):
                report["staging_memory"] = staging_memory(root, size, work)
            shutil.rmtree(root)
            for row in rows:
                shutil.rmtree(work / f"staged-{size}-t{row['threads']}", ignore_errors=True)
        if args.memory_budget_gb > 0:
            report["memory"] = memory_case(work, args)
    report["wall_s"] = time.perf_counter() - start
    report["conditions"]["loadavg_after"] = harness.loadavg()
    print(format_table(report), flush=True)
    return harness.write(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
