# model.pt exported next to it as export.formats asks (ddpflow.export): rules of their own,
# so an export is made from a finished run, never by retraining it.


rule export_safetensors:
    """model.safetensors: model.pt's tensors with their metadata; loads without code."""
    input:
        model=run_file("model"),
        staged=staged_dir,
    output:
        export_file("safetensors"),
    log:
        f"{LOGS}/export/{{run}}.safetensors.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    params:
        format="safetensors",
    script:
        "../../scripts/export.py"


rule export_torch_export:
    """model.pt2: a torch.export ExportedProgram (dynamic batch), checked against eager."""
    input:
        model=run_file("model"),
        staged=staged_dir,
    output:
        export_file("torch_export"),
    log:
        f"{LOGS}/export/{{run}}.torch_export.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    params:
        format="torch_export",
    script:
        "../../scripts/export.py"


rule export_onnx:
    """model.onnx: the ONNX graph (dynamic batch), checked with onnxruntime."""
    input:
        model=run_file("model"),
        staged=staged_dir,
    output:
        export_file("onnx"),
    log:
        f"{LOGS}/export/{{run}}.onnx.log",
    localrule: True
    conda:
        "../../envs/ddpflow.yaml"
    params:
        format="onnx",
    script:
        "../../scripts/export.py"


rule export:
    """`snakemake export`: every run's exports (export.formats)."""
    input:
        export_files(),
        # what `snakemake` makes: a model retrained for them brings its evaluation and the
        # report along, never a model newer than its metrics
        final_outputs(),
