"""What submitit pickles and each rank runs: a light reference to a rank task
(ddpflow.training.entry).

The rule that submits a job runs on the login node (or this machine) and only waits for it;
pickling the rank tasks' classes there would import torch in that process too (about 2 s per
rule, for nothing). These callables name the task instead and import it on the rank. The
name is a class attribute, not pickled: a job pickled before a rank task moved runs the task
where it is now. The layout before ddpflow.cluster named these classes ddpflow.jobs (an
alias set in ddpflow/__init__.py).

    # the rank runs ddpflow.training.entry.TrainTask(run, paths):
    executor.submit(TrainJob(run, paths))
"""

from __future__ import annotations

from ddpflow.paths import RunPaths


class _RankJob:
    task_module, task_name = "ddpflow.training.entry", ""

    def __init__(self, run: dict, paths: RunPaths, planned: dict | None = None):
        # planned: the login node's ddpflow, torch, CUDA and NCCL (cluster.software); a job
        # pickled before it was passed has none, and checks nothing
        self.run, self.paths, self.planned = run, paths, planned

    def __call__(self) -> dict:
        import atexit
        import gc
        import importlib

        from ddpflow.cluster import distenv, software

        # a rank holds millions of objects (torch and its compiler's modules) that the
        # interpreter's last collection scans at exit, 0.6-0.9 s a process on a CPU core;
        # frozen first, they are not scanned (atexit handlers and module teardown still run)
        atexit.register(gc.freeze)
        # this node's software is the login node's, before anything is built (the image)
        software.check_planned(getattr(self, "planned", None), distenv.discover().rank)
        module = importlib.import_module(self.task_module)
        return getattr(module, self.task_name)(self.run, self.paths)()


class TrainJob(_RankJob):
    """ddpflow.training.entry.TrainTask on each rank; requeued by submitit on a time limit or
    preemption (checkpoint(): the same job again, which resumes from its checkpoint)."""

    task_name = "TrainTask"

    def checkpoint(self, *args, **kwargs):
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


class EvalJob(_RankJob):
    """ddpflow.training.entry.EvalTask on each rank."""

    task_name = "EvalTask"


class PredictJob(_RankJob):
    """ddpflow.training.predict_ranks.PredictTask on each rank (`snakemake predict`)."""

    task_module, task_name = "ddpflow.training.predict_ranks", "PredictTask"


class GenerateJob(_RankJob):
    """ddpflow.training.generate_ranks.GenerateTask on each rank (`snakemake generate`)."""

    task_module, task_name = "ddpflow.training.generate_ranks", "GenerateTask"
