"""``python -m launch.local_slurm --root DIR --nodes N``: a real Slurm on this host until Ctrl-C (it prints the
SLURM_CONF to export). The code: megatron_qarl/launch/local_slurm.py."""

import sys

from megatron_qarl.launch.local_slurm import main

if __name__ == "__main__":
    sys.exit(main())
