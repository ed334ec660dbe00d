"""The probe of tests/test_megatron_cpu.py: install every Megatron CPU fix but one (``skip``), run ``scenario``
and print PROBE-OK, or fail with upstream's error. Each probe is a fresh process forked from the rank forkserver
(Megatron-Core and the learner imported once, no fix applied there), so a probe never sees another's fixes."""

from __future__ import annotations

import os
import sys
import traceback
import warnings


def install(skip: str) -> None:
    from megatron_qarl.moe import megatron_cpu as mc

    fixes = [fix for fix in mc.FIXES if fix.__name__ != skip.split(":")[0]]
    if skip == "fix_alltoall_streams:splits_only":  # keep the stream part, drop the split sizes
        from megatron.core.transformer.moe import token_dispatcher as td

        @mc.when(mc.cuda_absent)
        def fix_stream_only():
            mc._replace(td.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", "cpu")
            mc._replace(td.MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize", lambda self, point, t=None: t)

        fixes.append(fix_stream_only)
    mc.FIXES = tuple(fixes)
    mc.apply()  # init_parallel's apply() then finds the fixes installed: the skipped one stays out


def body(skip: str, scenario: str, model_dir: str) -> None:
    import torch

    warnings.filterwarnings("ignore")
    install(skip)
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.moe.model import Qwen3MoeArch, build_model, forward_logits
    from megatron_qarl.moe.parallelize import init_parallel

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    ep = 2 if scenario == "forward_ep2" else 1
    init_parallel(ep=ep)
    if scenario.startswith("forward"):
        model = build_model(arch, ep=ep)
        # Megatron's own alltoall dispatcher, as the TE spec runs it (the local spec's, moe/dispatch.py, reads its
        # split sizes itself and never reaches _maybe_dtoh_and_synchronize)
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        for module in model.modules():
            if isinstance(getattr(module, "token_dispatcher", None), MoEAlltoAllTokenDispatcher):
                module.token_dispatcher.__class__ = MoEAlltoAllTokenDispatcher
        forward_logits(model, torch.randint(0, 8, (1, 8)))
        return
    from megatron_qarl.qat.config import QuantConfig

    # w8a8_int8: attention's linears are ModelOpt quant modules of Megatron's (under w4a16 only the grouped experts
    # are, whose checkpoint entries are SequentialMLP's, without ModelOpt's extra state)
    quant = QuantConfig(scheme="w8a8_int8") if scenario == "checkpoint_quant" else None
    learner = Learner(arch, ParallelConfig(), OptimConfig(clip_grad=1.0 if scenario == "clip" else 0.0),
                      quant=quant, distributed_optimizer=scenario in ("distopt", "reshard"),
                      recompute="full" if scenario == "recompute" else "none")
    batch = Batch(torch.randint(0, arch.vocab_size, (2, 8)), torch.ones(2, 7))
    learner.train_step(batch, lambda logp, b: token_mean_nll(logp, b, 14))
    if scenario == "reshard":  # the model-space optimizer format, written and read back
        import tempfile

        from megatron_qarl.learner.checkpoint import load_learner, save_learner

        with tempfile.TemporaryDirectory() as d:
            save_learner(d, learner.module, learner.optimizer, "fully_reshardable")
            load_learner(d, learner.module, learner.optimizer)
    if scenario.startswith("checkpoint"):
        import tempfile

        from megatron.core import dist_checkpointing

        msd = learner.module.sharded_state_dict(prefix="model.")
        with tempfile.TemporaryDirectory() as d:
            dist_checkpointing.save({"model": msd, "optimizer": learner.optimizer.sharded_state_dict(msd)}, d)


def main(skip: str, scenario: str, model_dir: str, log: str, env: dict, cwd: str) -> None:
    """The probe process: stdout and stderr go to ``log`` (a traceback included); the caller's environment and
    directory, not the forkserver's. Exits 0 after PROBE-OK, 1 on a failure."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        from megatron_qarl.moe.parallelize import run_ranks

        run_ranks(2 if scenario == "forward_ep2" else 1, body, skip, scenario, model_dir)
        print("PROBE-OK", flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
