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
    # no job is left: Snakemake need not wait for its scheduler's timer, nor collect at exit
    from ddpflow.cluster.interrupts import exit_promptly

    exit_promptly()


onerror:
    # A rule failed (staging, training, ...) or Snakemake was stopped, and with keep-going
    # (both profiles) the other runs went on: the report rule needs every run, so write the
    # report of this config here, whatever failed: the runs that finished and, for each
    # other, why (ddpflow.report.outcome); else results/report/ would still describe the
    # last config. The next run redoes exactly the rest. First the finished outputs a failed
    # or stopped rerun removed come back (a stopped one is told how to go on, not to fix).
    from ddpflow.report.outcome import interrupted_runs, report_unfinished
    from ddpflow.cluster.interrupts import wait_for_rule_scripts

    # a stopped rule may still be cancelling its Slurm job: its record first
    wait_for_rule_scripts()
    stopped = interrupted_runs(RUNS, RESULTS)
    restored = [
        run for kept in KEPT_OUTPUTS for run in kept.restore_failed(stopped)
    ]
    report_unfinished(RUNS, RESULTS, restored, workflow.persistence)
    from ddpflow.cluster.interrupts import exit_promptly

    exit_promptly()
