rule track:
    """Log a finished run to the experiment trackers `tracking:` enables (MLflow, W&B), on
    this (login) node from the files the ranks wrote: compute nodes need no network and
    no tracker client. Writes the tracker run ids and URLs (ddpflow.tracking)."""
    input:
        model=run_file("model"),
        train_metrics=run_file("train_metrics"),
        train_summary=run_file("train_summary"),
        eval_metrics=run_file("eval_metrics"),
        # logged as the model, with its metadata (never the pickled model.pt)
        exports=safetensors_export,
    output:
        tracking=tracking_file(),
    log:
        f"{LOGS}/track/{{run}}.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    params:
        # where it logs: editing tracking: reruns this rule alone (and the report)
        *ddpconfig.as_params(ddpconfig.flatten({"tracking": config["tracking"]})),
    script:
        "../../scripts/track.py"
