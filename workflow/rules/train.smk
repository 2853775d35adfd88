rule train:
    """Train one run with DDP: a local rule that submits one submitit job (one task per rank)
    and waits; the ranks run on this machine (launcher: local) or on Slurm (profiles/slurm).
    """
    input:
        staged=staged_dir,
    output:
        model=f"{RESULTS}/runs/{{run}}/model.pt",
        metrics=f"{RESULTS}/runs/{{run}}/train_metrics.jsonl",
        summary=f"{RESULTS}/runs/{{run}}/train_summary.json",
    log:
        f"{LOGS}/train/{{run}}.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    threads: local_ranks
    params:
        run=run_cfg,
    script:
        "../../scripts/train.py"
