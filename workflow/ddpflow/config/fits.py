"""The old path of ddpflow.checks.memory, for plan.py and bench/memory_estimate.py: this
name is that module (sys.modules); remove once they import ddpflow.checks.memory."""

import sys

from ddpflow.checks import memory

sys.modules[__name__] = memory
