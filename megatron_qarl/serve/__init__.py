"""The embedded SGLang-protocol rollout server (``qarl serve``): HTTP app, engine, scheduler, sampling, weight updates;
``kernels`` its native low-bit CPU kernels (docs/rollout.md)."""
