"""Launching ranks: submitit jobs and their reattachment, rank discovery, failures read
from the ranks, interrupts, the preflight, the bad-node ledger and placement,
Slurm output parsing."""
