rule evaluate:
    """Score the trained model on the held-out split: every rank a disjoint unpadded shard,
    integer counts summed with one all_reduce."""
    input:
        staged=staged_dir,
        model=run_file("model"),
        train_summary=run_file("train_summary"),
    output:
        eval_metrics=run_file("eval_metrics"),
    log:
        f"{LOGS}/evaluate/{{run}}.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    threads: local_ranks
    params:
        *fingerprint_params(ddpconfig.evaluation_fingerprint, "eval_metrics"),
    script:
        "../../scripts/evaluate.py"
