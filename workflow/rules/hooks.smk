# Workflow hooks: run by Snakemake itself, in its main process.
onstart:
    # Snakemake does not signal running rule scripts when it is stopped (SIGINT, SIGTERM):
    # forward the stop to them, so their local or Slurm jobs are cancelled, not left running.
    from ddpflow.interrupts import forward_stop_signals

    forward_stop_signals()
