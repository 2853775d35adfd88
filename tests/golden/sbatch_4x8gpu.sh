#!/bin/bash

# Parameters
#SBATCH --account=proj
#SBATCH --constraint=a100
#SBATCH --cpus-per-task=12
#SBATCH --error=/scratch/proj/ddpflow/logs/submitit/big/train/%j_0_log.err
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --job-name=ddpflow-train-big
#SBATCH --mem=491520M
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --open-mode=append
#SBATCH --output=/scratch/proj/ddpflow/logs/submitit/big/train/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --qos=high
#SBATCH --signal=USR2@120
#SBATCH --time=720
#SBATCH --wckey=submitit

# setup
if [ ! -O /scratch/proj/ddpflow/logs/submitit/big/train ] || [ -n "$(find /scratch/proj/ddpflow/logs/submitit/big/train -maxdepth 0 -perm /022)" ] || [ -n "$(find /scratch/proj/ddpflow/logs/submitit/big /scratch/proj/ddpflow/logs/submitit -maxdepth 0 -perm /022 ! -perm -1000 2>/dev/null)" ]; then echo 'ddpflow: the job folder /scratch/proj/ddpflow/logs/submitit/big/train can be written by others or is not yours, or so can one of its parents (/scratch/proj/ddpflow/logs/submitit/big, /scratch/proj/ddpflow/logs/submitit): refusing to load its pickles; fix: chmod 700 /scratch/proj/ddpflow/logs/submitit/big/train and chmod go-w on the parent' >&2; exit 1; fi
module load cuda/12.4

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /scratch/proj/ddpflow/logs/submitit/big/train/%j_%t_log.out --error /scratch/proj/ddpflow/logs/submitit/big/train/%j_%t_log.err --cpus-per-task=12 --kill-on-bad-exit=1 /opt/ddpflow/.venv/bin/python -u -m submitit.core._submit /scratch/proj/ddpflow/logs/submitit/big/train
