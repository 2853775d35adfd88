# ddpflow: stage -> train (DDP via submitit) -> evaluate (distributed all-reduce) -> export
# -> report; `snakemake predict` applies the models to new data, `snakemake generate`
# continues prompts with the language models.
# Table of contents only; each stage lives in workflow/rules/. Edit config/config.yaml.


include: "workflow/rules/configfile.smk"


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/hooks.smk"
include: "workflow/rules/stage.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/predict.smk"
include: "workflow/rules/generate.smk"
include: "workflow/rules/track.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/clean.smk"


rule all:
    default_target: True
    input:
        final_outputs(),
