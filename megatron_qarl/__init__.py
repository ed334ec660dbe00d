"""megatron_qarl: rollout-aligned quantization-aware RL (QaRL) for Qwen3-MoE on Megatron-Core."""

__version__ = "0.1.0"
