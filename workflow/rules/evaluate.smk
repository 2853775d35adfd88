rule evaluate:
    """Score the trained model on the held-out split: every rank a disjoint unpadded shard,
    integer counts summed with one all_reduce."""
    input:
        staged=staged_dir,
        model=f"{RESULTS}/runs/{{run}}/model.pt",
        summary=f"{RESULTS}/runs/{{run}}/train_summary.json",
    output:
        metrics=f"{RESULTS}/runs/{{run}}/eval_metrics.json",
    log:
        f"{LOGS}/evaluate/{{run}}.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    threads: local_ranks
    params:
        run=run_cfg,
    script:
        "../../scripts/evaluate.py"
