rule report:
    """Collect every run into Markdown + self-contained HTML with plots."""
    input:
        train=expand(f"{RESULTS}/runs/{{run}}/train_metrics.jsonl", run=RUNS),
        evaluation=expand(f"{RESULTS}/runs/{{run}}/eval_metrics.json", run=RUNS),
    output:
        markdown=f"{RESULTS}/report/report.md",
        html=report(
            f"{RESULTS}/report/report.html",
            caption="../report/report.rst",
            category="Summary",
        ),
        plots=report(
            directory(f"{RESULTS}/report/plots"),
            patterns=["{name}.png"],
            caption="../report/plots.rst",
            category="Plots",
        ),
        summary=f"{RESULTS}/report/summary.json",
    log:
        f"{LOGS}/report.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    params:
        runs=list(RUNS),
    script:
        "../../scripts/report.py"
