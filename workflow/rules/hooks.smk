# Workflow hooks: run by Snakemake itself, in its main process.
onstart:
    # Snakemake does not signal running rule scripts when it is stopped (SIGINT, SIGTERM):
    # forward the stop to them, so their local or Slurm jobs are cancelled, not left running.
    from ddpflow.cluster.interrupts import forward_stop_signals

    forward_stop_signals()


onerror:
    # A run failed, and with keep-going (both profiles) the others trained on: the report
    # rule needs every run, so write the report of those that finished here, naming the
    # failed ones and why (ddpflow.report.outcome); the next run redoes exactly the rest.
    from ddpflow.report.outcome import report_unfinished

    report_unfinished(RUNS, RESULTS)
