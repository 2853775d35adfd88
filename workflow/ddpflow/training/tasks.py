"""The old path of ddpflow.training.entry, for training/predict.py; remove once it imports
ddpflow.training.entry. (Submitted jobs name their rank task in ddpflow.cluster.jobs, by
class attribute: no pickle holds this path.)"""

from ddpflow.training.entry import DistributedTask, EvalTask, TrainTask

__all__ = ["DistributedTask", "EvalTask", "TrainTask"]
