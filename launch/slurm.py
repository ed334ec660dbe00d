"""``python -m launch.slurm submit [--dry-run] [--sbatch-arg=ARG ...] --config CONFIG [key.sub=value ...]``: a Slurm
run of slurm/qarl.sbatch (``--help`` for every command). The code: megatron_qarl/launch/slurm.py."""

import sys

from megatron_qarl.launch.slurm import main

if __name__ == "__main__":
    sys.exit(main())
