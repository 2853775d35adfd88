"""ddpflow: multi-node PyTorch DDP training on Slurm, driven by Snakemake and submitit."""

__version__ = "0.1.0"
