"""The old path of ddpflow.checks.links, for tests/test_gpu.py and bench/collectives.py: this
name is that module (sys.modules); remove once they import ddpflow.checks.links."""

import sys

from ddpflow.checks import links

sys.modules[__name__] = links
