"""The old path of ddpflow.checks.early, for plan.py and bench/memory_estimate.py (which
also reads this file's folder as the package's); remove once they import
ddpflow.checks.early."""

from ddpflow.checks.early import (
    CACHE,
    RUNTIME,
    _footprint_key,
    _footprint_request,
    _judge,
    _measure,
    input_of,
    read_footprints,
)

__all__ = [
    "CACHE",
    "RUNTIME",
    "_footprint_key",
    "_footprint_request",
    "_judge",
    "_measure",
    "input_of",
    "read_footprints",
]
