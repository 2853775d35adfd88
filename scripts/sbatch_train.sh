#!/bin/bash
# Train and evaluate one ddpflow run with plain sbatch + srun (no Snakemake, no submitit).
# From the repository root (a shared filesystem), after `make run` or `pip install -e .`:
#
#   sbatch --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8 \
#          --partition=gpu --account=myproj scripts/sbatch_train.sh config/config.yaml default
#
# The #SBATCH lines below are defaults; command-line options override them. Each srun task is
# one rank: ddpflow reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and takes the first host
# of the node list as master, with a port derived from the job id (MASTER_PORT overrides).
#SBATCH --job-name=ddpflow
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=01:00:00
#SBATCH --signal=USR2@120
set -euo pipefail

CONFIG=${1:-config/config.yaml}
RUN=${2:-}
PYTHON=${DDPFLOW_PYTHON:-$(pwd)/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3
run_args=(--config "$CONFIG" --launcher slurm ${RUN:+--run "$RUN"})

# Staging is one process: run it in the batch step (it is a no-op check when already staged).
"$PYTHON" -m ddpflow stage "${run_args[@]}"

# Since Slurm 22.05 srun no longer inherits --cpus-per-task from the allocation; a dead rank
# ends the whole step (--kill-on-bad-exit) instead of leaving the others blocked.
step=(srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" "$PYTHON" -m ddpflow)
"${step[@]}" train "${run_args[@]}"
"${step[@]}" evaluate "${run_args[@]}"
