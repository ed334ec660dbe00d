"""The launchers for ``python -m`` from the repository root (not installed; the code they call is
``megatron_qarl.launch``). ``qarl slurm submit`` and ``qarl slurm local-cluster`` run the same code from any directory
(megatron_qarl/launch/cli.py):

    python -m launch.slurm submit --config CONFIG [key.sub=value ...]   sbatch slurm/qarl.sbatch for a run config
    python -m launch.local_slurm --root DIR --nodes N                   a real Slurm on this host, for trying the above
"""
