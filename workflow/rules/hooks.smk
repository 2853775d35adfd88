# Workflow hooks: run by Snakemake itself, in its main process.
KEPT_OUTPUTS = []  # the KeptOutputs of this workflow (set by onstart)


onstart:
    # Snakemake does not signal running rule scripts when it is stopped (SIGINT, SIGTERM):
    # forward the stop to them, so their local or Slurm jobs are cancelled, not left running.
    from ddpflow.cluster.interrupts import forward_stop_signals

    forward_stop_signals()
    # a failed rerun never costs a finished run: its outputs are hard-linked aside before
    # Snakemake deletes them and linked back by onerror (ddpflow.kept)
    from ddpflow.kept import KeptOutputs

    KEPT_OUTPUTS.append(KeptOutputs(workflow.persistence, RUNS, RESULTS))


onsuccess:
    for kept in KEPT_OUTPUTS:
        kept.drop()


onerror:
    # A run failed, and with keep-going (both profiles) the others trained on: the report
    # rule needs every run, so write the report of those that finished here, naming the
    # failed ones and why (ddpflow.report.outcome); the next run redoes exactly the rest.
    # First the finished outputs a failed rerun removed come back, so the report shows them.
    from ddpflow.report.outcome import report_unfinished

    restored = [run for kept in KEPT_OUTPUTS for run in kept.restore_failed()]
    report_unfinished(RUNS, RESULTS, restored)
