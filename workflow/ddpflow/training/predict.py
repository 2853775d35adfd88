"""The old path of ddpflow.training.predict_ranks; remove once cluster/jobs.py names
"ddpflow.training.predict_ranks" (submitted jobs name their rank task there, by class
attribute: no pickle holds this path)."""

from ddpflow.training.predict_ranks import Inputs, PredictTask, merge

__all__ = ["Inputs", "PredictTask", "merge"]
