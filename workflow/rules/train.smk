rule train:
    """Train one run with DDP: a local rule that submits one submitit job (one task per rank)
    and waits; the ranks run on this machine (launcher: local) or on Slurm (profiles/slurm).
    """
    input:
        staged=staged_dir,
        weights=weights_input,
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
        *fingerprint_params(ddpconfig.training_fingerprint, "model"),
    script:
        "../../scripts/train.py"


rule fetch_weights:
    """`snakemake fetch_weights`: download every run's torchvision weights into the local
    torch hub cache (where there is internet: the login node), checked against the hash in
    the file name and model.weights_sha256. The ranks never download."""
    output:
        torchvision_weight_files(),
    log:
        f"{LOGS}/fetch_weights.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    params:
        entries=torchvision_weight_entries(),
    script:
        "../../scripts/fetch_weights.py"
