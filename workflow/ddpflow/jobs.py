"""Shim for one release: jobs submitted before the package moved by concern.

submitit pickles the submitted callable by reference, as ``ddpflow.jobs.TrainJob`` (or
``EvalJob``) in the layout before ``ddpflow.cluster.jobs``. A job queued or requeued before the
upgrade unpickles on its nodes after it, so the old name must still resolve: it does, to the
same classes. Remove in the release after next (tests/test_package_layout.py checks it).
"""

from ddpflow.cluster.jobs import EvalJob, TrainJob

__all__ = ["EvalJob", "TrainJob"]
