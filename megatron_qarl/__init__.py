"""megatron_qarl: rollout-aligned quantization-aware RL (QaRL) for Qwen3-MoE on Megatron-Core.

The package, one subpackage a concept (README.md, "Map of the code"):

- ``config``: the typed run config (the schema); ``preflight``: what is checked before a run starts (the rules
  between components, ``load_config``)
- ``train``: ``qarl train`` and the QaRL loop (rollouts, async pipeline, evaluation, metrics, tracking)
- ``learner``: one Megatron learner rank, its worker, its checkpoints
- ``moe``: Qwen3-MoE on Megatron-Core (model, parallel groups, HF <-> Megatron conversion, TE, CPU fixes)
- ``qat``: the one quantizer, fake quant, export; ``algo``: advantages, policy losses, mismatch, routing replay
- ``rollout``: the trainer's side of every rollout backend (clients, rollout manager, SGLang and vLLM launchers, the
  vLLM extension); ``serve``: the embedded SGLang-protocol server (``qarl serve``), its engine and native kernels
- ``sync``: the weight sync (payload, transports, broadcaster, delta, verification)
- ``data``: the synthetic task, prompt files, rewards, ``qarl eval``, ``qarl data prepare``
- ``plan``: ``qarl plan`` (memory model and simulation); ``gpu``: the simulated CUDA device and the GPU smoke
- ``launch``: Ray, local and Slurm launching (``qarl slurm``); ``utils``: processes, HTTP, stack dumps
"""

__version__ = "0.1.0"
