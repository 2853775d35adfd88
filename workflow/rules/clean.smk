rule clean_work:
    """Free disk in results/work/: set-aside checkpoints of edited configs, stale rendezvous
    files and the checkpoints of finished trainings. An interrupted training keeps its
    checkpoints (a rerun resumes from them). Run by name: snakemake clean_work"""
    log:
        f"{LOGS}/clean_work.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    params:
        work=f"{RESULTS}/work",
    script:
        "../../scripts/clean_work.py"
