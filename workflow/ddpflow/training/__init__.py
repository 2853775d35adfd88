"""What runs on each rank: the entry (entry.py: TrainTask, EvalTask), the training loop,
checkpoints and the workspace, sharding, models, the distributed evaluation, fault injection
for drills."""
