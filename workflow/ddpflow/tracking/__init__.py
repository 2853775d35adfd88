"""Experiment trackers (MLflow, Weights & Biases), fed by the track rule on the login node.

The ranks never talk to a tracker: once a run is evaluated, the track rule
(workflow/rules/track.smk) reads the files they wrote (train_metrics.jsonl,
train_summary.json, eval_metrics.json, model.pt) and logs them to each tracker that
`tracking:` enables, so compute nodes need no network and no tracker client. Which module
does what:

- record.py: one run's files -> a RunRecord (flattened config as params, per-epoch step
  metrics, the final test figures, tags, artifacts) and its identity (model + evaluation).
- mlflow_backend.py: log a RunRecord to an MLflow server or sqlite database; superseded
  runs are tagged.
- wandb_backend.py: log a RunRecord to W&B, offline (a run folder to `wandb sync` later) or
  online.
- live.py: while the ranks train, the train rule's poll streams each new epoch to an MLflow
  run that the track rule later completes.
- track.py: the rule's function: the previous results/runs/<run>/tracking.json (its copy in
  the work folder), what to log again, failures named with the URI and cause.

The clients are an optional extra (envs/tracking.txt, `make tracking`): nothing here
imports mlflow or wandb before a tracker is used, and ddpflow.config refuses a config that
enables a tracker whose client is missing.
"""
