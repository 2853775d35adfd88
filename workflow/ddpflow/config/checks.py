"""The old path of ddpflow.checks.values and ddpflow.checks.batch, for modules that still
import it (config/runs.py, export.py); remove once they import ddpflow.checks."""

from ddpflow.checks.batch import check_batch_fits, resolve_micro_batch
from ddpflow.checks.values import ONNX_MODULES, check_export, check_tracking
from ddpflow.checks.values import check_resolved_run as _check_run

__all__ = [
    "ONNX_MODULES",
    "_check_run",
    "check_batch_fits",
    "check_export",
    "check_tracking",
    "resolve_micro_batch",
]
