rule predict_run:
    """Apply one run's model to predict.input on the run's machine (one Slurm job, or the
    local ranks): each input scored once by one rank, merged in input order into
    predictions.csv (ddpflow.predict, ddpflow.training.predict_ranks)."""
    input:
        staged=staged_dir,
        model=run_file("model"),
    output:
        predictions=predict_file("predictions"),
        predictions_summary=predict_file("predictions_summary"),
    log:
        f"{LOGS}/predict/{{run}}.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    threads: local_ranks
    params:
        # what the predictions depend on besides the model: the settings and the input's
        # files (an added or rewritten file re-plans this rule, not a retraining)
        *ddpconfig.as_params(ddpconfig.flatten({"predict": PREDICT_SETTINGS})),
        input_files=predict_checked,
    script:
        "../../scripts/predict.py"


rule predict:
    """`snakemake predict`: predictions.csv of every run (or of predict.runs)."""
    input:
        expand(predict_file("predictions"), run=PREDICT_RUNS),
        # what `snakemake` makes: a model retrained for these (an edited science) brings
        # its evaluation, exports and the report along, never a model newer than its metrics
        final_outputs(),
