"""Getting ranks onto machines: placing and submitting a run's job (submit.py, placement.py,
launch.py, jobs.py) and reattaching to it, the Slurm cluster asked and its output parsed,
the bad-node ledger, failures read from the ranks, interrupts; on the ranks, rank discovery
and the rendezvous. Imports ddpflow.config, never ddpflow.checks (but placement.py re-checks
a run at the node count it gets)."""
