"""The checks made before a run's work starts, each module named by what it checks. On the
login node, at Snakemake's parse and in the train rule, before anything is queued (no torch
imported; what needs torch runs in early.py's subprocess):

- values.py: combinations of config values the schema cannot express, suspicious settings,
  trackers and exports whose packages are missing.
- batch.py: the global batch against the machine: a world size that cannot split it,
  micro-batch auto, a global batch larger than the staged split.
- host.py: what this machine has (GPUs, their memory, bf16 instructions).
- memory.py, memory_knobs.py: a rank's peak memory against what it has, and the knobs a
  refusal offers.
- slurm.py: every run's machine section against the real cluster (partition, account,
  nodes, GPUs, time limit).
- weight_files.py: model.weights (what it names, its sha256, fetch_weights).
- model_kwargs.py: gpt's model.kwargs.
- early.py: the train rule's refusals made at parse time, with the memory estimate; its
  subprocess builds the models.

On the allocated ranks, before the first step (imports torch):

- links.py: the ranks' links measured (bus bandwidth), slow ranks and hosts named.
"""
