rule stage:
    """Stage a dataset into ddpflow's checksummed format (shared by runs with equal data)."""
    output:
        directory(f"{RESULTS}/staged/{{dataset}}"),
    log:
        f"{LOGS}/stage/{{dataset}}.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    threads: stage_threads
    params:
        data=lambda wildcards: data_cfg_for(wildcards.dataset),
    script:
        "../../scripts/stage.py"
