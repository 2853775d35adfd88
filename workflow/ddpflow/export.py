"""Exports of a run's model.pt that load without ddpflow (the export rules, on the login node).

    safetensors   model.safetensors: model.pt's state dict, tensor for tensor, with string
                  metadata (ddpflow version, task, model name and kwargs, class names, input
                  shape, normalisation, the staged data's digest, the training config hash).
                  Loading it runs no code (a pickle can).
    torch_export  model.pt2: a torch.export ExportedProgram of the model in eval mode with a
                  dynamic batch dimension, loaded back and checked to give the eager model's
                  outputs on a batch of another size before it is published.
    onnx          model.onnx: torch.onnx's dynamo exporter, with a dynamic batch dimension,
                  checked with onnxruntime against the eager model (needs `make onnx`).

Every file is written under a temporary name and renamed once checked: a failed export leaves
no half-written file for Snakemake to take as done.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

from ddpflow import __version__
from ddpflow.checks.values import ONNX_MODULES
from ddpflow.checks.weight_files import input_normalisation
from ddpflow.config import config_hash, training_fingerprint
from ddpflow.errors import UserError
from ddpflow.paths import EXPORT_FILES, work_dir
from ddpflow.task import DEFAULT_TASK, run_task

log = logging.getLogger(__name__)

# how close an export's outputs must be to the eager model's (fp32, the same kernels or not)
RTOL, ATOL = 1e-4, 1e-5


def data_digest(manifest: dict) -> str:
    """One sha256 for the staged data: of its files' sha256 sums, by name."""
    files = {name: entry["sha256"] for name, entry in sorted(manifest["files"].items())}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def metadata(run: dict, checkpoint: dict, manifest: dict, model_sha256: str) -> dict[str, str]:
    """What a user of the export needs to rebuild the input and read the output (strings:
    safetensors' metadata is a str -> str map; lists and dicts as JSON)."""
    mean, std, _ = input_normalisation(checkpoint["model"], manifest)
    return {
        "format": "ddpflow",
        "ddpflow_version": __version__,
        "run": run["name"],
        "task": run.get("task") or DEFAULT_TASK,
        "model": json.dumps(checkpoint["model"], sort_keys=True),
        "class_names": json.dumps(manifest["class_names"]),
        "input_shape": json.dumps(list(checkpoint["shape"])),
        # x = (pixels / 255 - mean) / std, per channel, pixels uint8 0..255 in C x H x W
        "normalize_mean": json.dumps(mean),
        "normalize_std": json.dumps(std),
        "data_sha256": data_digest(manifest),
        "config_hash": config_hash(training_fingerprint(run)),
        "model_pt_sha256": model_sha256,
    }


# the safetensors export rank 0 writes beside model.pt (results/work/<run>/), which the export
# rule publishes once it is shown to be this model's: the rule then needs no torch
PREPARED = "model.safetensors.prepared"


def wants_safetensors(run: dict) -> bool:
    """Whether export.formats (carried in the resolved run) asks for this run's safetensors
    export, and its task makes one."""
    formats = (run.get("export") or {}).get("formats") or ()
    applies = run_task(run).exports
    return "safetensors" in formats and (applies is None or "safetensors" in applies)


def prepare_safetensors(run: dict, checkpoint: dict, manifest: dict, sha256: str, work) -> None:
    """Rank 0, right after it wrote model.pt (whose sha256 it is): the safetensors export
    of the weights it holds, into the run's work folder, for the export rule to publish."""
    prepared = Path(work) / PREPARED
    meta = metadata(run, checkpoint, manifest, sha256)
    _write_checked(prepared, lambda tmp: _safetensors(checkpoint["state_dict"], meta, tmp))


def _published(run: dict, model_path: str, manifest: dict, out: str) -> dict | None:
    """The export rank 0 prepared, moved to out where its metadata names this run, its data,
    its training config and this very model.pt (by sha256); None where there is none or it
    is another model's (then it is removed, and exported anew)."""
    from ddpflow.runtime import sha256_file

    prepared = work_dir(run["results_dir"], run["name"]) / PREPARED
    try:
        with prepared.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            meta = json.loads(file.read(length)).get("__metadata__") or {}
    except (OSError, ValueError, struct.error):
        return None
    same = all(meta.get(key) == value for key, value in _identity(run, manifest).items())
    if not same or meta.get("model_pt_sha256") != sha256_file(Path(model_path)):
        log.info("run %r: the training job's export is another model's", run["name"])
        prepared.unlink(missing_ok=True)
        return None
    os.replace(prepared, out)
    log.info("run %r: %s written (safetensors, by the training job)", run["name"], out)
    return {"format": "safetensors", "path": out, "bytes": os.path.getsize(out), "metadata": meta}


def _identity(run: dict, manifest: dict) -> dict[str, str]:
    """The metadata that ties an export to its run, data and training config (the model.pt
    it was made from is checked by its sha256)."""
    return {
        "format": "ddpflow",
        "ddpflow_version": __version__,
        "run": run["name"],
        "task": run.get("task") or DEFAULT_TASK,
        "data_sha256": data_digest(manifest),
        "config_hash": config_hash(training_fingerprint(run)),
    }


def export_run(run: dict, model_path: str, staged: str, out: str, fmt: str) -> dict:
    """Export model_path (a run's model.pt) as fmt into out; returns what was written."""
    if fmt not in EXPORT_FILES:
        raise UserError(f"export.formats: unknown format {fmt!r}; one of {sorted(EXPORT_FILES)}")
    task = run_task(run)
    applies = task.exports  # a language model's: safetensors only
    if applies is not None and fmt not in applies:
        raise UserError(
            f"run {run['name']!r}: task {task.name} exports {', '.join(applies)} "
            f"only, not {fmt} (its Task.exports; docs/tasks.md)"
        )
    manifest = json.loads((Path(staged) / "manifest.json").read_text())
    if fmt == "safetensors" and (published := _published(run, model_path, manifest, out)):
        return published
    import torch

    from ddpflow import runtime
    from ddpflow.runtime import sha256_file
    from ddpflow.training.models import from_checkpoint

    checkpoint = runtime.safe_torch_load(model_path, torch.device("cpu"))
    meta = metadata(run, checkpoint, manifest, sha256_file(Path(model_path)))

    def write(tmp: Path) -> None:
        if fmt == "safetensors":
            _safetensors(checkpoint["state_dict"], meta, tmp)
        else:
            model = from_checkpoint(checkpoint, torch.device("cpu"), channels_last=False)
            (_torch_export if fmt == "torch_export" else _onnx)(model, checkpoint, tmp)

    _write_checked(Path(out), write)
    log.info("run %r: %s written (%s)", run["name"], out, fmt)
    return {"format": fmt, "path": str(out), "bytes": os.path.getsize(out), "metadata": meta}


def _write_checked(path: Path, write) -> None:
    """write(tmp) under a temporary name beside path, made as readable as model.pt
    (safetensors writes 0600), then renamed: a failure leaves no half-written file."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")  # its suffix kept
    try:
        write(tmp)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _safetensors(state_dict: dict, meta: dict[str, str], path: Path) -> None:
    from safetensors.torch import save_file

    # safetensors refuses tensors that share memory or are not contiguous; model.pt holds
    # each tensor once (a state dict's own), laid out as trained (channels_last too), except
    # tied weights (gpt's output layer is its token embedding): those are written as copies,
    # so that every key of the state dict is in the file, and named in metadata "tied"
    tensors, tied = {}, {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for key, value in state_dict.items():
        at = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if at in seen:
            tied[key] = seen[at]
            value = value.clone()
        seen.setdefault(at, key)
        tensors[key] = value.detach().contiguous()
    if tied:
        meta = {**meta, "tied": json.dumps(tied, sort_keys=True)}
    save_file(tensors, str(path), metadata=meta)


def _examples(checkpoint: dict):
    """Two batches of other sizes (the dynamic dimension must not be specialised to one)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    shape = list(checkpoint["shape"])
    return [torch.randn(n, *shape, generator=generator) for n in (2, 3)]


def _torch_export(model, checkpoint: dict, path: Path) -> None:
    import torch

    first, other = _examples(checkpoint)
    batch = torch.export.Dim("batch", min=1, max=65536)
    with torch.no_grad():
        program = torch.export.export(model, (first,), dynamic_shapes=({0: batch},))
        torch.export.save(program, str(path))
        loaded = torch.export.load(str(path)).module()
        _check_close(model(other), loaded(other), "torch_export")


def _onnx(model, checkpoint: dict, path: Path) -> None:
    import numpy as np
    import torch

    missing = [name for name in ONNX_MODULES if not _importable(name)]
    if missing:
        raise UserError(
            f"export.formats has onnx but {', '.join(missing)} is not installed: run "
            "`make onnx` (envs/onnx.txt), or leave onnx out of export.formats"
        )
    import onnxruntime

    first, other = _examples(checkpoint)
    batch = torch.export.Dim("batch", min=1, max=65536)
    with torch.no_grad():
        program = torch.onnx.export(
            model, (first,), dynamo=True, dynamic_shapes=({0: batch},), verbose=False
        )
        assert program is not None  # dynamo=True returns the ONNXProgram
        program.save(str(path))
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        got = session.run(None, {name: other.numpy()})[0]
        _check_close(model(other), torch.from_numpy(np.asarray(got)), "onnx")


def _check_close(expected, got, fmt: str) -> None:
    import torch

    try:
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    except AssertionError as err:
        raise RuntimeError(
            f"the {fmt} export does not give the eager model's outputs: {err}"
        ) from None


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
