rule clean_work:
    """Free disk in results/work/: set-aside checkpoints of edited configs, stale rendezvous
    files and the checkpoints of finished trainings. An interrupted training keeps its
    checkpoints (a rerun resumes from them). The bad-node ledger stays (snakemake
    clean_bad_nodes). Run by name: snakemake clean_work"""
    log:
        f"{LOGS}/clean_work.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    params:
        work=f"{RESULTS}/work",
    script:
        "../../scripts/clean_work.py"


rule clean_bad_nodes:
    """Forget the nodes that failed under the workflow's Slurm jobs (the ledger
    results/work/bad_nodes.json): run it once they are repaired, and the next jobs may use
    them again. clean_work keeps the ledger. Run by name: snakemake clean_bad_nodes"""
    log:
        f"{LOGS}/clean_bad_nodes.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    params:
        ledger=str(ddppaths.bad_nodes_file(RESULTS)),
    script:
        "../../scripts/clean_bad_nodes.py"
