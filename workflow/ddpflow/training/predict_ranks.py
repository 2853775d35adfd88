"""What every rank runs for `snakemake predict`: its unpadded shard of the input, prepared as
the run's data was staged, through the run's model; rank 0 merges the shards in input order.

Each input has a global index (its place in the request's listing: ddpflow.predict). Rank r
scores [start, stop) of evaluate.shard_bounds, the same contiguous unpadded shards as the
evaluation, so each input is scored once at any world size, and writes one JSON line per
input to results/work/<run>/predict/part-<r>.jsonl. After one collective (did any rank
meet an input that does not decode, under predict.on_corrupt: fail?) rank 0 reads the parts
in rank order, checks that every index appears exactly once, and writes predictions.csv and
predictions.json atomically.

Preparation: a folder's images are decoded as staging decodes an image folder (the run's
channels; resized to cover its height x width, then centre-cropped: data.image_size's
fitting, smaller images upscaled), an npz's images taken as they are; then normalised with
the train split's statistics, as the evaluation does. The model runs in eval mode in fp32.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import socket
import time
from pathlib import Path

import numpy as np
import torch

from ddpflow import runtime
from ddpflow.cluster.distenv import DistEnv, any_rank
from ddpflow.config import uses_channels_last
from ddpflow.config.typed import RunSpec
from ddpflow.data.image_folder import decode_all
from ddpflow.data.npz import npz_images
from ddpflow.data.raw import DataError
from ddpflow.monitoring.flops import read_admitted
from ddpflow.paths import PREDICT_WORK
from ddpflow.predict import REQUEST, input_count
from ddpflow.task import run_task
from ddpflow.training import evaluate
from ddpflow.training.entry import DistributedTask
from ddpflow.training.models import from_checkpoint
from ddpflow.training.rankdata import normalisation
from ddpflow.words import counted

log = logging.getLogger(__name__)

SHOWN = 20  # corrupt inputs named in an error or the log


class PredictTask(DistributedTask):
    def work(self, spec: RunSpec, env: DistEnv, device, hosts) -> dict:
        begin = time.perf_counter()
        folder = Path(self.paths.work) / PREDICT_WORK
        request = json.loads((folder / REQUEST).read_text())
        manifest = json.loads((Path(self.paths.staged) / "manifest.json").read_text())
        checkpoint = runtime.safe_torch_load(self.paths.model, device)
        model = from_checkpoint(checkpoint, device, uses_channels_last(spec))
        listing, settings = request["input"], request["settings"]
        n = input_count(listing)
        start, stop = evaluate.shard_bounds(n, env.world_size, env.rank)
        batch = settings["batch_size"] or evaluate.batch_size(spec, read_admitted(self.paths.work))
        inputs = Inputs(listing, manifest["shape"])
        norm = normalisation(manifest, device, checkpoint["model"])
        task = run_task(spec)
        corrupt = 0
        with (folder / f"part-{env.rank}.jsonl").open("w") as part:
            for first in range(start, stop, batch):
                last = min(first + batch, stop)
                pixels, failed = inputs.read(first, last)
                corrupt += len(failed)
                for index, why in failed.items():
                    part.write(json.dumps({"index": index, "error": why}) + "\n")
                kept = [i for i in range(first, last) if i not in failed]
                if kept:
                    rows = _predict(model, task, manifest, pixels, norm, device, settings)
                    for index, row in zip(kept, rows, strict=True):
                        part.write(json.dumps({"index": index, **row}) + "\n")
        log.info(
            "rank %d predicted inputs %d..%d (%s unreadable) in %.1fs",
            env.rank,
            start,
            stop - 1,
            corrupt,
            time.perf_counter() - begin,
        )
        refused = any_rank(env.world_size, corrupt > 0 and settings["on_corrupt"] == "fail")
        if env.world_size > 1:
            torch.distributed.barrier()  # every part is closed before rank 0 reads them
        if refused:
            raise DataError(_corrupt_message(folder, env.world_size, listing))
        if not env.is_master:
            return {"rank": env.rank, "host": socket.gethostname()}
        return merge(folder, env.world_size, n, listing, request["out"], hosts, begin)


@torch.no_grad()
def _predict(model, task, manifest, pixels: np.ndarray, norm, device, settings) -> list[dict]:
    x = evaluate.normalize(torch.from_numpy(pixels).to(device), *norm)
    outputs = model(x).float().cpu()
    return task.predictions(outputs, manifest, **task.prediction_options(settings))


class Inputs:
    """The request's inputs as uint8 [k, C, H, W] in the run's shape, a range at a time."""

    def __init__(self, listing: dict, shape: list[int]):
        self.listing, self.shape = listing, list(shape)
        self.images = None
        if listing["kind"] == "npz":
            with np.load(listing["path"]) as arrays:
                self.images = npz_images(arrays, "images", Path(listing["path"]))

    def read(self, first: int, last: int) -> tuple[np.ndarray, dict[int, str]]:
        """(pixels of the inputs that decode, {index: why} of those that do not)."""
        if self.images is not None:
            return np.ascontiguousarray(self.images[first:last]), {}
        channels, height, width = self.shape
        root = Path(self.listing["root"])
        paths = [root / name for name in self.listing["files"][first:last]]
        mode = "L" if channels == 1 else "RGB"
        decoded = decode_all(paths, height, width, mode, True)
        failed = {
            first + i: str(detail) for i, (pixels, detail) in enumerate(decoded) if pixels is None
        }
        out = np.empty((len(paths) - len(failed), channels, height, width), np.uint8)
        kept = (pixels for pixels, _ in decoded if pixels is not None)
        for row, pixels in enumerate(kept):
            out[row] = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
        return out, failed


def _parts(folder: Path, world: int):
    for rank in range(world):
        with (folder / f"part-{rank}.jsonl").open() as part:
            for line in part:
                yield json.loads(line)


def _name(listing: dict, index: int) -> str:
    """An input's path column: its path relative to predict.input, or images[i] in an npz."""
    return listing["files"][index] if listing["kind"] == "folder" else f"images[{index}]"


def _corrupt_message(folder: Path, world: int, listing: dict) -> str:
    bad = [(_name(listing, r["index"]), r["error"]) for r in _parts(folder, world) if "error" in r]
    where = listing.get("root", listing.get("path"))
    shown = "; ".join(f"{name}: {why}" for name, why in bad[:SHOWN])
    more = f"; and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
    return (
        f"predict.input {where}: {counted(len(bad), 'input')} could not be read: {shown}{more}. "
        "Replace or remove them, or set predict.on_corrupt: skip to predict the others"
    )


def merge(folder: Path, world: int, n: int, listing: dict, out: dict, hosts, begin) -> dict:
    """predictions.csv in input order from the ranks' parts (every index exactly once) and
    predictions.json: what was predicted from what."""
    rows: list[dict | None] = [None] * n
    for row in _parts(folder, world):
        index = row.pop("index")
        if rows[index] is not None:
            raise RuntimeError(f"input {index} was predicted twice: the shards overlap")
        rows[index] = row
    missing = [i for i, row in enumerate(rows) if row is None]
    if missing:
        raise RuntimeError(f"{counted(len(missing), 'input')} not predicted, e.g. {missing[:5]}")
    skipped = [_name(listing, i) for i, row in enumerate(rows) if row and "error" in row]
    text = io.StringIO()
    columns = ["path", "prediction", "score"]
    # the task's own keys of a prediction (Task.predictions: top_k, probabilities, ...)
    said = (k for r in rows if r and "error" not in r for k in r)
    extra = list(dict.fromkeys(k for k in said if k not in columns))
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(columns + extra)
    for index, row in enumerate(rows):
        if row is None or "error" in row:
            continue
        cells = [_name(listing, index), _cell(row["prediction"]), _cell(row["score"])]
        writer.writerow(cells + [_cell(row.get(k)) for k in extra])
    runtime.atomic_write_bytes(out["predictions"], text.getvalue().encode())
    summary = {
        "input": listing.get("root", listing.get("path")),
        "kind": listing["kind"],
        "inputs": n,
        "predicted": n - len(skipped),
        "skipped": skipped,
        "world_size": world,
        "hosts": sorted(set(hosts)),
        "columns": columns + extra,
        "seconds": time.perf_counter() - begin,
    }
    runtime.atomic_write_json(out["predictions_summary"], summary)
    if skipped:
        log.warning(
            "%s skipped (predict.on_corrupt: skip): %s",
            counted(len(skipped), "input"),
            ", ".join(skipped[:SHOWN]),
        )
    return summary


def _cell(value) -> str:
    """A CSV cell: a number as Python writes it (round-trips), a list as JSON."""
    if value is None:
        return ""
    if isinstance(value, list | tuple | dict):
        return json.dumps(value)
    return str(value)
