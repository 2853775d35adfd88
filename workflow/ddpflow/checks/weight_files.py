"""model.weights on the login node, without torch: what the spec names (a file, a torchvision
weights name, run:NAME), the file's full sha256 (cached by path, size and modification time,
so a parse hashes a file once), and the checks that refuse a wrong or missing file before
anything is submitted. The ranks load the file (ddpflow.training.weights) and check the
sha256 again.

    identity = describe(config, run, resolve_named)   # run["weights"], at config resolution
    problem = refusal(run["weights"])                   # None, or what is wrong and the fix
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from ddpflow.config.schema import ConfigError
from ddpflow.runtime import atomic_write_json, sha256_file

RUN_PREFIX = "run:"
# "DEFAULT", "IMAGENET1K_V1", "ResNet18_Weights.IMAGENET1K_V1": a torchvision weights name
TORCHVISION_NAME = re.compile(r"^(?:([A-Za-z0-9_]+_Weights)\.)?([A-Z][A-Z0-9_]*)$")
HASH_CACHE = Path(".snakemake", "ddpflow", "weights-sha256.json")
# where torchvision's own downloads come from; `snakemake fetch_weights` reads this instead
# when it is set (an institute's mirror of download.pytorch.org/models/)
MIRROR_ENV = "DDPFLOW_WEIGHTS_MIRROR"


def kind(spec: str) -> str:
    """ "run", "torchvision" or "file" (an existing path is a file whatever its name)."""
    if spec.startswith(RUN_PREFIX):
        return "run"
    if not Path(spec).expanduser().exists() and TORCHVISION_NAME.match(spec):
        return "torchvision"
    return "file"


def describe(config: dict, run: dict, resolve_named: Callable[[str], dict]) -> dict | None:
    """What run's model.weights is, with its identity (in the training fingerprint): a file's
    or a torchvision file's sha256 ("missing" when it is not there yet), or, for run:NAME, the
    training fingerprint of NAME (resolve_named(NAME) gives its resolved run): editing NAME
    changes this run's fingerprint, and NAME's model.pt is this run's input."""
    spec = run["model"].get("weights")
    if spec is None:
        return None
    where = f"run {run['name']!r}: model.weights {spec!r}"
    found = kind(spec)
    if found == "run":
        return _from_run(config, run, spec, where, resolve_named)
    if found == "torchvision":
        return _torchvision(run, spec, where)
    path = Path(spec).expanduser().resolve()
    return {"spec": spec, "kind": "file", "path": str(path), "sha256": file_sha256(path)}


def _from_run(config: dict, run: dict, spec: str, where: str, resolve_named) -> dict:
    from ddpflow.config.fingerprint import config_hash, training_fingerprint
    from ddpflow.paths import RUN_FILES

    name = spec.removeprefix(RUN_PREFIX)
    if name == run["name"]:
        raise ConfigError(f"{where}: a run cannot start from its own model; name another run")
    try:
        source = resolve_named(name)
    except RecursionError:
        raise ConfigError(f"{where}: the runs' model.weights form a cycle") from None
    except ConfigError as err:
        if "form a cycle" in str(err):  # raised where the cycle closed: said once
            raise
        raise ConfigError(f"{where}: {err}") from None
    path = Path(run["results_dir"], "runs", name, RUN_FILES["model"])
    return {
        "spec": spec,
        "kind": "run",
        "run": name,
        "path": str(path),
        "source_fingerprint": config_hash(training_fingerprint(source)),
    }


def _torchvision(run: dict, spec: str, where: str) -> dict:
    """A torchvision weights name of run's model, its URL and its place in the hub cache."""
    model = run["model"]["name"]
    found = torchvision_weights(model, spec)
    if isinstance(found, str):
        raise ConfigError(f"{where}: {found}")
    full, url, mean, std = found
    path = hub_checkpoints() / url.rsplit("/", 1)[-1]
    return {
        "spec": spec,
        "kind": "torchvision",
        "torchvision": full,
        "url": url,
        "path": str(path),
        "sha256": file_sha256(path),
        "mean": mean,
        "std": std,
    }


def torchvision_weights(model: str, spec: str) -> list | str:
    """[the full name "ResNet18_Weights.IMAGENET1K_V1", its URL, the input mean and std its
    transforms normalise with], or why it is not one:
    found by torchvision, once per model, name and torchvision version (cached beside the
    hashes: a parse imports no torch once it is known)."""
    from importlib.metadata import version

    key = f"{model}\0{spec}\0torchvision {version('torchvision')}"
    cache_file = HASH_CACHE.with_name("torchvision-weights.json")
    return _cached(cache_file, key, lambda: _ask_torchvision(model, spec))


@functools.cache
def _ask_torchvision(model: str, spec: str) -> list[str] | str:
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(model)
    except (ValueError, KeyError):
        return (
            f"{model!r} has no torchvision weights (a torchvision name applies to a "
            "torchvision model; give a file or run:NAME instead)"
        )
    match = TORCHVISION_NAME.match(spec)
    assert match is not None  # kind() said so
    owner, short = match.groups()
    if owner is not None and owner != enum.__name__:
        return f"{owner} are not weights of {model!r}, whose weights are {enum.__name__}"
    names = [member.name for member in enum]
    if short != "DEFAULT" and short not in names:
        return f"{enum.__name__} has no {short}; it has DEFAULT, {', '.join(names)}"
    weights = enum.DEFAULT if short == "DEFAULT" else enum[short]
    transforms = weights.transforms()
    mean, std = getattr(transforms, "mean", None), getattr(transforms, "std", None)
    return [f"{enum.__name__}.{weights.name}", weights.url, mean, std]


def input_normalisation(model: dict, manifest: dict) -> tuple[list, list, str]:
    """(mean, std, what they are) a model's inputs are normalised with: torchvision weights'
    own (their transforms': ImageNet's statistics for most), else the train split's."""
    if manifest.get("kind") == "tokens":  # a language model reads token ids as they are
        return [], [], "none (token ids)"
    spec = model.get("weights")
    if spec and kind(spec) == "torchvision":
        found = torchvision_weights(model["name"], spec)
        if not isinstance(found, str) and found[2] and found[3]:
            return list(found[2]), list(found[3]), f"the mean and std of {found[0]}"
    return list(manifest["mean"]), list(manifest["std"]), "the train split's mean and std"


def hub_checkpoints() -> Path:
    """torch.hub's download folder, as torch.hub.get_dir() computes it: $TORCH_HOME/hub or
    $XDG_CACHE_HOME/torch/hub, then ~/.cache/torch/hub; checkpoints/ under it."""
    home = os.environ.get("TORCH_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "torch"
    )
    return Path(home).expanduser() / "hub" / "checkpoints"


def mirror_url(url: str) -> str:
    """The URL fetch_weights downloads from: DDPFLOW_WEIGHTS_MIRROR + the file name if set."""
    mirror = os.environ.get(MIRROR_ENV)
    return f"{mirror.rstrip('/')}/{url.rsplit('/', 1)[-1]}" if mirror else url


def file_sha256(path: Path) -> str:
    """The file's full sha256, "missing" if it is not a file; cached in
    .snakemake/ddpflow/weights-sha256.json by (path, size, mtime_ns)."""
    if not path.is_file():
        return "missing"
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return _cached(HASH_CACHE, key, lambda: sha256_file(path), stale=f"{path.resolve()}\0")


def _cached(cache_file: Path, key: str, compute, stale: str | None = None):
    """cache_file's entry for key (a JSON object), computed and written when missing (then
    the entries starting with `stale` go: an older version of the same file)."""
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        if stale:
            cache = {k: v for k, v in cache.items() if not k.startswith(stale)}
        cache[key] = compute()
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(cache_file, cache)
        except OSError:
            pass  # a read-only working directory: computed again at the next parse
    return cache[key]


def refusal(run: dict) -> str | None:
    """Why run's weights cannot be used as they are now, with the fix; None when they can.
    A run:NAME source is made by the workflow (NAME's train job) and not checked here."""
    weights = run.get("weights")
    if not weights or weights["kind"] == "run":
        return None
    where = f"run {run['name']!r}: model.weights {weights['spec']!r}"
    path, found = weights["path"], weights["sha256"]
    if weights["kind"] == "torchvision":
        if found == "missing":
            return (
                f"{where}: {weights['torchvision']} is not in the local torch hub cache, "
                f"and no rank downloads anything: put {weights['url']} at {path} "
                "(`snakemake fetch_weights` does that where there is internet, e.g. on "
                "the login node; TORCH_HOME moves the cache)"
            )
        prefix = hash_prefix(path)
        if prefix and not found.startswith(prefix):
            return (
                f"{where}: {path} is damaged: its sha256 {found} does not start with "
                f"the {prefix} in its file name; delete it and run `snakemake "
                "fetch_weights` again"
            )
    elif found == "missing":
        return (
            f"{where}: no file {path}; give an existing .pt/.pth/.safetensors file, a "
            "torchvision weights name (DEFAULT, IMAGENET1K_V1) or run:NAME"
        )
    pinned = run["model"].get("weights_sha256")
    if pinned and pinned != found:
        return (
            f"{where}: {path} has sha256 {found}, but model.weights_sha256 expects "
            f"{pinned}: the file was replaced or damaged; put the expected file back, or "
            "set model.weights_sha256 to the new hash if the new file is meant"
        )
    return None


def hash_prefix(path: str | Path) -> str | None:
    """The sha256 prefix torchvision writes in its file names (resnet18-f37072fd.pth)."""
    match = re.search(r"-([a-f0-9]{6,})\.", Path(path).name)
    return match.group(1) if match else None


def fetch_all(entries: dict[str, dict]) -> None:
    """Download each torchvision weights file that is not in the hub cache yet (torch.hub:
    a temporary file, moved into place only when the sha256 prefix in its name matches),
    then check the whole file against model.weights_sha256 where one is set."""
    import logging

    from torch.hub import download_url_to_file

    log = logging.getLogger(__name__)
    if not entries:
        log.info("no run's model.weights is a torchvision name: nothing to fetch")
    for path, entry in sorted(entries.items()):
        target = Path(path)
        if target.is_file():
            log.info("%s: already at %s", entry["torchvision"], target)
            continue
        url = mirror_url(entry["url"])
        log.info("%s: downloading %s to %s", entry["torchvision"], url, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            download_url_to_file(url, str(target), hash_prefix=hash_prefix(target), progress=True)
        except RuntimeError as err:  # torch.hub's 'invalid hash value'
            raise ConfigError(
                f"{entry['torchvision']}: the download from {url} is damaged "
                f"({err}); nothing was written to {target}; try again, or "
                f"check {MIRROR_ENV}"
            ) from None
        except OSError as err:
            raise ConfigError(
                f"{entry['torchvision']}: cannot download {url} ({err}); on a "
                f"machine with internet run `snakemake fetch_weights`, or copy "
                f"the file to {target}"
            ) from None
        found = file_sha256(target)
        if entry.get("pin") and entry["pin"] != found:
            target.unlink()
            raise ConfigError(
                f"{entry['torchvision']}: the downloaded file has sha256 "
                f"{found}, but model.weights_sha256 expects {entry['pin']}; "
                f"removed it from {target}"
            )
        log.info("%s: %s, sha256 %s", entry["torchvision"], target, found)
