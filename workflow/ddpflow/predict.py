"""`snakemake predict`, on the login node: what predict.input holds, its signature (what
re-plans the predict rule) and the request the ranks read (ddpflow.training.predict_ranks does the
work on the run's machine).

predict.input is a folder of images, listed recursively in sorted order of its relative
paths (a file's global index is its place in that order: how each input is scored exactly
once at any world size), or an .npz file with an `images` array. The listing is made once,
here; the ranks read it from the request, so a file added while they run is not half-seen.
Nothing here imports torch (the Snakefile's parse calls it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from pathlib import Path

import numpy as np

from ddpflow.config import ConfigError
from ddpflow.data.folder_problems import IGNORED_NAMES
from ddpflow.paths import PREDICT_WORK, RunPaths
from ddpflow.runtime import atomic_write_json
from ddpflow.words import counted

REQUEST = "request.json"
log = logging.getLogger(__name__)


def predict_run_names(predict: dict, run_names) -> list[str]:
    """predict.runs (checked: each a run of this config), or every run."""
    unknown = [name for name in predict["runs"] if name not in run_names]
    if unknown:
        raise ConfigError(
            f"predict.runs names {unknown}, which are not runs of this config; the runs are "
            f"{sorted(run_names)} (or leave predict.runs empty for all)"
        )
    return list(predict["runs"]) or list(run_names)


def image_extensions() -> set[str]:
    from PIL import Image

    return {ext.lower() for ext in Image.registered_extensions()}


def list_input(predict: dict) -> dict:
    """predict.input's listing: {"kind": "folder", "root", "files": [relative paths]} or
    {"kind": "npz", "path", "count", "shape"}; a ConfigError naming the key and the fix for
    one that is missing, empty or of another kind."""
    given = predict["input"]
    if not given:
        raise ConfigError(
            "predict.input is not set: set it to a folder of images or an .npz file with an "
            "`images` array (in config.yaml, or --config 'predict={input: new_images}')"
        )
    path = Path(given).expanduser()
    if path.is_dir():
        return _list_folder(path, given)
    if path.is_file() and path.suffix == ".npz":
        return _npz_header(path, given)
    if path.exists():
        raise ConfigError(
            f"predict.input {given}: neither a folder of images nor an .npz file; give one"
        )
    raise ConfigError(f"predict.input {given}: no such file or folder ({path.resolve()})")


def _list_folder(root: Path, given: str) -> dict:
    extensions = image_extensions()
    files = []
    for path in root.rglob("*"):
        if path.name.startswith(".") or path.name in IGNORED_NAMES or not path.is_file():
            continue
        if path.suffix.lower() in extensions:
            files.append(path.relative_to(root).as_posix())
    if not files:
        raise ConfigError(
            f"predict.input {given}: no image files in it (extensions Pillow reads, e.g. "
            ".png .jpg), looked for recursively; put the images to predict there"
        )
    return {"kind": "folder", "root": str(root.resolve()), "files": sorted(files)}


def _npz_header(path: Path, given: str) -> dict:
    """The npz's `images` array's shape and dtype, read from its header (not loaded)."""
    try:
        with zipfile.ZipFile(path) as archive, archive.open("images.npy") as member:
            version = np.lib.format.read_magic(member)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read(member)
    except KeyError:
        raise ConfigError(
            f"predict.input {given}: no `images` array in it; save the images to predict "
            "with np.savez(path, images=array)"
        ) from None
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        raise ConfigError(f"predict.input {given}: not a readable .npz file ({err})") from None
    if dtype != np.uint8 or len(shape) not in (3, 4) or not shape[0]:
        raise ConfigError(
            f"predict.input {given}: images has shape {list(shape)} and dtype {dtype}; "
            "expected uint8 pixel values 0..255, [N, H, W], [N, H, W, C] or [N, C, H, W]"
        )
    return {
        "kind": "npz",
        "path": str(path.resolve()),
        "count": int(shape[0]),
        "shape": [int(s) for s in shape],
    }


def input_count(listing: dict) -> int:
    """How many inputs a listing holds: a folder's files or an npz's images."""
    return len(listing["files"]) if listing["kind"] == "folder" else listing["count"]


def signature(listing: dict) -> str:
    """What re-plans predict, as Snakemake's rerun reason shows it: the input's path and,
    per file, its relative path, size and modification time (an added, removed or rewritten
    file changes it), hashed, with the count of files beside the hash."""
    digest = hashlib.sha256()
    if listing["kind"] == "npz":
        stat = Path(listing["path"]).stat()
        entries = [[listing["path"], stat.st_size, stat.st_mtime_ns]]
    else:
        root = Path(listing["root"])
        entries = [[root.as_posix()]]
        for name in listing["files"]:
            stat = (root / name).stat()
            entries.append([name, stat.st_size, stat.st_mtime_ns])
    digest.update(json.dumps(entries).encode())
    what = "an npz file" if listing["kind"] == "npz" else f"{input_count(listing)} files"
    return f"predict.input contents={what}, sha256 {digest.hexdigest()[:16]}"


def check_shape(listing: dict, shape: list[int], run_name: str) -> None:
    """An npz's images must have the run's sample shape (a folder's images are fitted)."""
    if listing["kind"] != "npz":
        return
    got = listing["shape"][1:]
    channels, height, width = shape
    allowed = [[channels, height, width], [height, width, channels]]
    if channels == 1:
        allowed.append([height, width])
    if got not in allowed:
        raise ConfigError(
            f"predict.input {listing['path']}: images are {got} per sample; run {run_name!r} "
            f"takes {shape} (C, H, W; or H, W, C): prepare them as its data was staged"
        )


def check_can_predict(run: dict) -> None:
    """Refuse, before any job, a run whose task cannot predict: one that says why
    (Task.no_prediction: a language model), or one that does not define predictions()
    (optional in the Task protocol: such a task trains, evaluates and reports; only predict
    needs it)."""
    from ddpflow.task import run_task

    name, task = run["name"], run_task(run)
    if task.no_prediction is not None:
        raise ConfigError(f"predict: run {name!r} {task.no_prediction}")
    if task.can_predict():
        return
    raise ConfigError(
        f"predict: run {name!r} has task {run['task']!r} ({task.name}), which does not say "
        "what a prediction is: snakemake predict calls the task's predictions(self, outputs, "
        "manifest) -> list[dict], outputs being the model's outputs for a batch (a tensor "
        "[N, outputs(manifest)]) and each dict one row of predictions.csv, "
        '{"prediction": ..., "score": ...}. The method is optional: without it the task '
        "trains, evaluates and reports, and only predict is refused. Add it to the task "
        "(docs/tasks.md), or name other runs in predict.runs"
    )


SHOWN = 20  # unreadable inputs named in a refusal
DECODED = "predict-decoded.json"  # the listings' signatures whose every image decoded


def check_decodes(listing: dict, predict: dict, cache_dir: str | Path) -> None:
    """Under predict.on_corrupt: fail, refuse once, before any job, a folder with an image
    that does not decode, naming each (up to SHOWN) and why. A listing that decoded is
    kept by its signature (paths, sizes, modification times) in cache_dir/DECODED: the next
    invocation reads nothing again until a file changes."""
    if listing["kind"] != "folder" or predict["on_corrupt"] != "fail":
        return
    cache, key = Path(cache_dir) / DECODED, signature(listing)
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = []
    if key in known:
        return
    root = Path(listing["root"])
    bad = [(name, why) for name in listing["files"] if (why := _unreadable(root / name))]
    if bad:
        shown = "; ".join(f"{name}: {why}" for name, why in bad[:SHOWN])
        more = f"; and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
        raise ConfigError(
            f"predict.input {predict['input']}: {counted(len(bad), 'input')} could not be "
            f"read: {shown}{more}. Replace or remove them, or set predict.on_corrupt: skip to "
            "predict the others"
        )
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cache, [*known[-9:], key])  # the last few inputs predicted


def _unreadable(path: Path) -> str | None:
    """Why an image does not decode (as the ranks decode it: opened and loaded), or None."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.draft(image.mode, (64, 64))  # a JPEG decoded at a fraction: still read whole
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        return str(err)
    return None


def write_request(work: str, listing: dict, predict: dict, out: dict) -> Path:
    """The ranks' request in results/work/<run>/predict/ (the work folder: never a declared
    output), and the parts of an earlier attempt removed."""
    folder = Path(work) / PREDICT_WORK
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("part-*.jsonl"):
        stale.unlink()
    request = {"input": listing, "settings": predict, "out": out}
    atomic_write_json(folder / REQUEST, request)
    return folder / REQUEST


def predict_run(run: dict, paths: RunPaths, logs_dir: str, predict: dict, out: dict) -> dict:
    """The predict rule: list and check predict.input, write the ranks' request, submit
    the run's job (its machine: one Slurm job, or the local ranks) and wait for it."""
    from ddpflow.cluster import submit
    from ddpflow.cluster.jobs import PredictJob

    check_can_predict(run)  # refused at parse already (predict.smk): here for API callers
    listing = list_input(predict)
    manifest = json.loads((Path(paths.staged) / "manifest.json").read_text())
    check_shape(listing, manifest["shape"], run["name"])
    write_request(paths.work, listing, predict, out)
    log.info("predict %r: %d inputs from %s", run["name"], input_count(listing), predict["input"])
    placed, exclude = submit.placed(run, paths, "predict")
    computes = {"predict": predict, "predict_input": signature(listing)}
    summary = submit.submit_and_wait(
        PredictJob, "predict", placed, paths, logs_dir, exclude, computes=computes
    )[0]
    skipped = ""
    if summary["skipped"]:
        names = summary["skipped"]
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        skipped = f", {len(names)} skipped ({shown}; predict.on_corrupt: skip)"
    log.info(
        "predict %r: %d predictions%s on %s in %s",
        run["name"],
        summary["predicted"],
        skipped,
        counted(summary["world_size"], "rank"),
        out["predictions"],
    )
    return summary
