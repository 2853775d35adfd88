"""The old path of ddpflow.checks.early, for plan.py and bench/memory_estimate.py: this
name is that module (sys.modules); remove once they import ddpflow.checks.early."""

import sys

from ddpflow.checks import early

sys.modules[__name__] = early
