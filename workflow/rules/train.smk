rule train:
    """Train one run with DDP: a local rule that submits one submitit job (one task per rank)
    and waits; the ranks run on this machine (launcher: local) or on Slurm (profiles/slurm)."""
    input:
        staged=staged_dir,
    output:
        model=f"{RESULTS}/runs/{{run}}/model.pt",
        metrics=f"{RESULTS}/runs/{{run}}/train_metrics.jsonl",
        summary=f"{RESULTS}/runs/{{run}}/train_summary.json",
    params:
        run=run_cfg,
        results=RESULTS,
    log:
        f"{LOGS}/train/{{run}}.log",
    threads: local_ranks
    localrule: True
    script:
        "../../scripts/train.py"
