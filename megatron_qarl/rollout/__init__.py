"""Rollouts, the trainer's side: clients for SGLang's and vLLM's APIs, the rollout manager, the launchers and
supervised processes of every backend, the vLLM extension (docs/rollout.md). The embedded server is ``serve``."""
