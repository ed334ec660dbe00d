"""Rollouts: the embedded CPU inference engine and its SGLang-compatible HTTP server (docs/rollout.md)."""
