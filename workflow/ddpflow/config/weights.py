"""The old path of ddpflow.checks.weight_files, which scripts/fetch_weights.py imports (a
rule script is never edited: its mtime would retrain every finished run). New code imports
ddpflow.checks.weight_files."""

from ddpflow.checks.weight_files import (
    HASH_CACHE,
    MIRROR_ENV,
    RUN_PREFIX,
    describe,
    fetch_all,
    file_sha256,
    hash_prefix,
    hub_checkpoints,
    input_normalisation,
    kind,
    mirror_url,
    refusal,
    torchvision_weights,
)

__all__ = [
    "HASH_CACHE",
    "MIRROR_ENV",
    "RUN_PREFIX",
    "describe",
    "fetch_all",
    "file_sha256",
    "hash_prefix",
    "hub_checkpoints",
    "input_normalisation",
    "kind",
    "mirror_url",
    "refusal",
    "torchvision_weights",
]
