rule stage:
    """Stage a dataset into ddpflow's checksummed format (shared by runs with equal data)."""
    output:
        directory(f"{RESULTS}/staged/{{dataset}}"),
    log:
        f"{LOGS}/stage/{{dataset}}.log",
    # machine.stage.where: job sends it to Slurm through the profile's executor plugin
    localrule: STAGE_WHERE == "login"
    conda:
        "../../envs/ddpflow.yaml"
    threads: stage_threads
    resources:
        **stage_resources(),
    params:
        data=lambda wildcards: data_cfg_for(wildcards.dataset),
    script:
        "../../scripts/stage.py"
