"""What runs on each rank: the tasks, the training loop, checkpoints and the workspace,
sharding, models, the distributed evaluation, fault injection for drills."""
