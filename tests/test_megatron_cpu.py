"""Each Megatron CPU fix is still needed: without it, the upstream failure it cures comes back.

When one of these tests fails, upstream no longer needs that fix: delete it from
megatron_qarl/megatron_cpu.py together with its test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_qarl import megatron_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the fixes apply only without CUDA")

PROBE = textwrap.dedent('''
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch


    def install(skip):
        from megatron_qarl import megatron_cpu as mc
        for fix in mc.FIXES:
            if fix.__name__ != skip.split(":")[0]:
                fix()
        if skip == "fix_alltoall_streams:splits_only":  # keep the stream part, drop the split sizes
            from megatron.core.transformer.moe import token_dispatcher as td
            td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu"
            td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = lambda self, point, t=None: t
        mc._APPLIED.append("probe")  # apply() must not install the skipped fix


    def body(skip, scenario, model_dir):
        warnings.filterwarnings("ignore")
        install(skip)
        from megatron_qarl.config import OptimConfig, ParallelConfig
        from megatron_qarl.learner import Batch, Learner, token_mean_nll
        from megatron_qarl.moe.model import Qwen3MoeArch, build_model, forward_logits
        from megatron_qarl.moe.parallelize import init_parallel

        arch = Qwen3MoeArch.from_model_dir(model_dir)
        ep = 2 if scenario == "forward_ep2" else 1
        init_parallel(ep=ep)
        if scenario.startswith("forward"):
            forward_logits(build_model(arch, ep=ep), torch.randint(0, 8, (1, 8)))
            return
        from megatron_qarl.qat.config import QuantConfig
        quant = QuantConfig(scheme="w4a16") if scenario == "checkpoint_quant" else None
        learner = Learner(arch, ParallelConfig(), OptimConfig(clip_grad=1.0 if scenario == "clip" else 0.0),
                          quant=quant)
        batch = Batch(torch.randint(0, arch.vocab_size, (2, 8)), torch.ones(2, 7))
        learner.train_step(batch, lambda logp, b: token_mean_nll(logp, b, 14))
        if scenario.startswith("checkpoint"):
            import tempfile
            from megatron.core import dist_checkpointing
            msd = learner.module.sharded_state_dict(prefix="model.")
            with tempfile.TemporaryDirectory() as d:
                dist_checkpointing.save({"model": msd, "optimizer": learner.optimizer.sharded_state_dict(msd)}, d)


    if __name__ == "__main__":
        from megatron_qarl.moe.parallelize import run_ranks
        from probe_mod import body as picklable_body

        skip, scenario, model_dir = sys.argv[1:4]
        run_ranks(2 if scenario == "forward_ep2" else 1, picklable_body, skip, scenario, model_dir)
        print("PROBE-OK")
''')


@pytest.fixture(scope="module")
def probe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "probe_mod.py"
    path.write_text(PROBE)
    return path


def _probe(probe_file, skip: str, scenario: str, model_dir: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(probe_file.parent), *sys.path]))
    return subprocess.run([sys.executable, str(probe_file), skip, scenario, model_dir],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("scenario", ["clip", "forward_ep2", "checkpoint", "checkpoint_quant"])
def test_all_fixes_together_run(scenario, random_model_dir, probe_file):
    res = _probe(probe_file, "none", scenario, random_model_dir)
    assert "PROBE-OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize("fix, scenario, upstream_error", [
    ("fix_current_device", "forward", "Torch not compiled with CUDA enabled"),
    ("fix_alltoall_streams", "forward", "torch.cuda.Stream requires CUDA support"),
    ("fix_alltoall_streams:splits_only", "forward_ep2", "all_to_all_single"),
    ("fix_te_general_gemm", "forward", "NameError: name 'te_general_gemm' is not defined"),
    ("fix_optimizer_device", "step", "Torch not compiled with CUDA enabled"),
    ("fix_clip_grads", "clip", "assert param.grad.type() == 'torch.cuda.FloatTensor'"),
    ("fix_checkpoint_preload", "checkpoint", "Torch not compiled with CUDA enabled"),
    ("fix_modelopt_extra_state_sync", "checkpoint_quant", "_modelopt_get_extra_state"),
])
def test_fix_is_still_needed(fix, scenario, upstream_error, random_model_dir, probe_file):
    assert fix.split(":")[0] in [f.__name__ for f in megatron_cpu.FIXES]
    res = _probe(probe_file, fix, scenario, random_model_dir)
    assert "PROBE-OK" not in res.stdout, f"upstream no longer needs {fix}: remove it"
    assert upstream_error in res.stderr, res.stderr[-3000:]


def test_upstream_torch_norm_still_refuses_sequence_parallel():
    """megatron_cpu.RMSNorm exists because WrappedTorchNorm asserts not sequence_parallel."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True)
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(cfg, 8)
    norm = megatron_cpu.RMSNorm(cfg, 8, eps=1e-6)
    assert norm.weight.sequence_parallel is True


def test_rmsnorm_matches_transformers():
    from megatron.core.transformer import TransformerConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, use_cpu_initialization=True)
    ours, ref = megatron_cpu.RMSNorm(cfg, 16, eps=1e-6), Qwen3MoeRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        w = torch.randn(16)
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    x = torch.randn(3, 5, 16)
    assert torch.equal(ours(x), ref(x))
    xb = x.bfloat16()
    assert torch.equal(ours.bfloat16()(xb), ref.bfloat16()(xb))


def test_apply_is_a_no_op_with_cuda(monkeypatch):
    monkeypatch.setattr(megatron_cpu, "needed", lambda: False)
    monkeypatch.setattr(megatron_cpu, "_APPLIED", [])
    assert megatron_cpu.apply() == []
