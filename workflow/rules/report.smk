from ddpflow.report import sweep as ddpsweep


rule report:
    """Collect every run into Markdown + self-contained HTML with plots."""
    input:
        train=expand(run_file("train_metrics"), run=RUNS),
        evaluation=expand(run_file("eval_metrics"), run=RUNS),
        # after the trackers, to show their run ids; a tracker that fails leaves the
        # report to Snakemake's onerror hook (hooks.smk), which calls the run finished
        tracking=tracked_files(),
        # the exports, which it links
        exports=export_files(),
    output:
        markdown=report_file("markdown"),
        html=report(
            report_file("html"),
            caption="../report/report.rst",
            category="Summary",
        ),
        plots=report(
            directory(report_file("plots")),
            patterns=["{name}.png"],
            caption="../report/plots.rst",
            category="Plots",
        ),
        summary=report_file("summary"),
        summary_csv=report_file("summary_csv"),
    log:
        f"{LOGS}/report.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    params:
        # `python -m ddpflow report` passes the same to the same function (build_report)
        runs=list(RUNS),
        # each run's sweep point (None for a `runs:` entry), without the list of its peers:
        # the report ranks a sweep's runs by their task's validation metric (ddpflow.report.sweep)
        sweeps=[ddpsweep.slim(run.get("sweep")) for run in RUNS.values()],
    script:
        "../../scripts/report.py"
