"""The launchers users run from the repository root (not installed; the code they call is ``megatron_qarl.launch``):

    python -m launch.slurm submit --config CONFIG [key.sub=value ...]   sbatch slurm/qarl.sbatch for a run config
    python -m launch.local_slurm --root DIR --nodes N                   a real Slurm on this host, for trying the above
"""
