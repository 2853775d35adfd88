"""Watching the ranks: per-rank system sampling, rank statistics and stragglers, Slurm job
efficiency."""
