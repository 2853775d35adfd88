rule train:
    """Train one run with DDP: a local rule that submits one submitit job (one task per rank)
    and waits; the ranks run on this machine (launcher: local) or on Slurm (profiles/slurm).
    """
    input:
        staged=staged_dir,
    output:
        model=run_file("model"),
        train_metrics=run_file("train_metrics"),
        train_summary=run_file("train_summary"),
    log:
        f"{LOGS}/train/{{run}}.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    threads: local_ranks
    params:
        *fingerprint_params(ddpconfig.training_fingerprint),
    script:
        "../../scripts/train.py"
