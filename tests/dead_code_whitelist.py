"""Names vulture reports as unused (tests/test_dead_code.py) that are not dead code: each is a parameter whose
caller fixes the signature. One line per name: the name, where it stands, and which protocol needs it."""
# ruff: noqa: B018, F821

exc  # __exit__/__aexit__(self, *exc) of LocalSlurm, RewardScorer, SGLangClient: the context-manager protocol
frame  # data/reward.py on_alarm(signum, frame): the signal-handler signature
types  # megatron_cpu.py __torch_function__(self, func, types, ...): torch's TorchFunctionMode protocol
non_blocking  # megatron_cpu.py preload_tensors(write_buckets, non_blocking=...): Megatron passes it by keyword
