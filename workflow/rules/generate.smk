# `snakemake generate`: the language models continue generate.prompts (ddpflow.generate).
# Not part of `rule all`, and in no run's fingerprint: nothing here retrains. Helpers:
# common.smk (GENERATE_RUNS, generate_file, generate_prompts).


rule generate_run:
    """Continue generate.prompts with one run's model on the run's machine (one Slurm job,
    or the local ranks): each prompt continued once by one rank, merged in prompt order into
    generations.jsonl (ddpflow.generate, ddpflow.training.generate_ranks)."""
    input:
        staged=staged_dir,
        model=run_file("model"),
        prompts=generate_prompts,
    output:
        generations=generate_file("generations"),
    log:
        f"{LOGS}/generate/{{run}}.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    threads: local_ranks
    params:
        # what the generations depend on besides the model and the prompts' file
        *ddpconfig.as_params(ddpconfig.flatten({"generate": GENERATE_SETTINGS})),
    script:
        "../../scripts/generate.py"


rule generate:
    """`snakemake generate`: generations.jsonl of every run (or of generate.runs)."""
    input:
        expand(generate_file("generations"), run=GENERATE_RUNS),
        # what `snakemake` makes: a model retrained for these (an edited science) brings
        # its evaluation, exports and the report along, never a model newer than its metrics
        final_outputs(),
