"""Each Megatron CPU fix is still needed: without it, the upstream failure it cures comes back. Each is keyed on the
condition of its failure, they are installed all or none, and a learner of a GPU run never falls back to them.

When one of the "still needed" tests fails, upstream no longer needs that fix: delete it from
megatron_qarl/moe/megatron_cpu.py together with its test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import megatron_cpu_probe
import pytest
import torch

from megatron_qarl.errors import UserError
from megatron_qarl.moe import megatron_cpu, parallelize

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the fixes apply only without CUDA")


def _probe(tmp_path, skip: str, scenario: str, model_dir: str) -> str:
    """Run tests/megatron_cpu_probe.py's probe in a process of its own; its output (PROBE-OK or a traceback).
    The process is forked from the rank forkserver, which has imported Megatron-Core, ModelOpt and the learner
    once and applied no fix (a fresh interpreter per probe spent about 15 s of CPU importing them)."""
    log = tmp_path / f"probe-{skip.replace(':', '-')}-{scenario}.log"
    proc = parallelize.rank_context().Process(
        target=megatron_cpu_probe.main, args=(skip, scenario, model_dir, str(log), dict(os.environ), os.getcwd()))
    proc.start()
    proc.join(timeout=300)
    if proc.is_alive():
        proc.kill()
        pytest.fail(f"probe {skip} {scenario} still running after 300 s:\n{log.read_text()[-3000:]}")
    return log.read_text()


@pytest.mark.parametrize("scenario", ["clip", "forward_ep2", "checkpoint", "checkpoint_quant", "distopt",
                                      "recompute", "reshard"])
def test_all_fixes_together_run(scenario, random_model_dir, tmp_path):
    out = _probe(tmp_path, "none", scenario, random_model_dir)
    assert "PROBE-OK" in out, out[-3000:]


@pytest.mark.parametrize("fix, scenario, upstream_error", [
    ("fix_current_device", "forward", "Torch not compiled with CUDA enabled"),
    ("fix_alltoall_streams", "forward", "torch.cuda.Stream requires CUDA support"),
    ("fix_alltoall_streams:splits_only", "forward_ep2", "all_to_all_single"),
    ("fix_te_general_gemm", "forward", "NameError: name 'te_general_gemm' is not defined"),
    ("fix_optimizer_device", "step", "Torch not compiled with CUDA enabled"),
    ("fix_clip_grads", "clip", "assert param.grad.type() == 'torch.cuda.FloatTensor'"),
    ("fix_cuda_synchronize", "checkpoint", "in preload_tensors"),  # the torch_dist writer's host copies
    ("fix_cuda_synchronize", "checkpoint_quant", "in _modelopt_get_extra_state"),  # ModelOpt's quantizer state
    ("fix_distributed_optimizer_types", "distopt", "Wrapped parameters must be one of torch.cuda.FloatTensor"),
    ("fix_recompute_rng", "recompute", "torch.cuda.random.get_rng_state"),
    ("fix_reshardable_adam_step", "reshard", "KeyError: 'step'"),  # torch's Adam state in a fully_reshardable load
])
def test_fix_is_still_needed(fix, scenario, upstream_error, random_model_dir, tmp_path):
    assert fix.split(":")[0] in [f.__name__ for f in megatron_cpu.FIXES]
    out = _probe(tmp_path, fix, scenario, random_model_dir)
    assert "PROBE-OK" not in out, f"upstream no longer needs {fix}: remove it"
    assert upstream_error in out, out[-3000:]


def test_fix_te_min_version_lets_the_offload_optimizer_config_build():
    """Without TE, Megatron's OptimizerConfig for optimizer CPU offload (precision-aware) raises TypeError unless
    fix_te_min_version is in force."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_qarl.learner.rank import offload_kwargs

    def build():
        return OptimizerConfig(optimizer="adam", use_distributed_optimizer=True, bf16=True,
                               params_dtype=torch.bfloat16, **offload_kwargs(True))

    megatron_cpu.remove()
    try:
        with pytest.raises(TypeError, match="'>=' not supported between instances of 'NoneType'"):
            build()
    finally:
        megatron_cpu.apply()
    assert build().optimizer_cpu_offload is True


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


def _names(fixes) -> list[str]:
    return [f.__name__ for f in fixes]


def test_each_fix_is_keyed_on_the_condition_of_its_failure(monkeypatch):
    """This machine (Linux, no CUDA, no Transformer Engine, no Apex) needs every fix; a Linux GPU without TE and Apex
    (the H200 smoke machine) needs the TE fixes, the multi-tensor and Adam fallbacks' and the checkpoint writer's; a
    GPU with TE the latter only, and elsewhere than Linux none; the TE fix follows Megatron's own HAVE_TE, the
    fallbacks' fixes what clip_grads.py bound."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer.moe import moe_utils

    every = _names(megatron_cpu.FIXES)
    fallbacks = ["fix_multi_tensor_fallbacks", "fix_torch_adam", "fix_reshardable_adam_step"]
    assert _names(megatron_cpu.needed_fixes()) == every
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _names(megatron_cpu.needed_fixes()) == ["fix_te_general_gemm", "fix_te_min_version", *fallbacks,
                                                   "fix_write_results_queue"]
    monkeypatch.setattr(moe_utils, "HAVE_TE", True)
    monkeypatch.setattr(clip_grads, "multi_tensor_applier", object())  # as TE's or Apex's
    assert _names(megatron_cpu.needed_fixes()) == ["fix_write_results_queue"]
    monkeypatch.setattr(megatron_cpu.sys, "platform", "darwin")
    assert _names(megatron_cpu.needed_fixes()) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _names(megatron_cpu.needed_fixes()) == [n for n in every if n not in ("fix_te_general_gemm",
                                                                                 "fix_te_min_version", *fallbacks,
                                                                                 "fix_write_results_queue")]


def test_a_fix_without_a_condition_is_refused(monkeypatch):
    def fix_unkeyed():
        pass

    monkeypatch.setattr(megatron_cpu, "_installed", None)
    monkeypatch.setattr(megatron_cpu, "FIXES", (*megatron_cpu.FIXES, fix_unkeyed))
    with pytest.raises(TypeError, match="fix_unkeyed declare no condition"):
        megatron_cpu.apply()


def _owners():
    """Everything the fixes replace attributes of."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    from megatron.core.optimizer import optimizer as opt
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import token_dispatcher as td

    return [torch.cuda, td.MoEAlltoAllTokenDispatcher, moe_utils, opt, opt.FP32Optimizer, opt.MixedPrecisionOptimizer,
            opt.MegatronOptimizer, opt.ChainedOptimizer, fa]


def _changed(before: list[dict], owners) -> list[str]:
    """The 'owner.name' attributes that differ (by identity) from the snapshot ``before``."""
    out = []
    for snap, owner in zip(before, owners, strict=True):
        now = dict(vars(owner))
        out += [f"{getattr(owner, '__name__', owner)}.{k}" for k in snap.keys() | now.keys()
                if snap.get(k, megatron_cpu._MISSING) is not now.get(k, megatron_cpu._MISSING)]
    return out


def test_apply_installs_all_or_none_and_names_the_fix_that_failed(monkeypatch):
    owners = _owners()
    before = [dict(vars(o)) for o in owners]

    @megatron_cpu.when(lambda: True)
    def fix_that_fails():
        megatron_cpu._replace(torch.cuda, "current_device", lambda: "elsewhere")  # half done, then it fails
        raise ImportError("no module named 'upstream_thing'")

    monkeypatch.setattr(megatron_cpu, "_installed", None)
    monkeypatch.setattr(megatron_cpu, "FIXES", (megatron_cpu.fix_current_device, megatron_cpu.fix_alltoall_streams,
                                                fix_that_fails, megatron_cpu.fix_clip_grads))
    with pytest.raises(RuntimeError, match=r"fix_that_fails failed \(ImportError: no module named 'upstream_thing'\); "
                                           r"the 2 fixes installed before it \(fix_current_device, "
                                           r"fix_alltoall_streams\) were undone, so none is in force"):
        megatron_cpu.apply()
    assert _changed(before, owners) == []
    assert megatron_cpu._installed is None  # nothing in force: a later apply() tries again


def test_remove_restores_every_attribute_the_fixes_replaced():
    megatron_cpu.remove()  # an earlier test in this process may have installed them: start from upstream's state
    owners = _owners()
    before = [dict(vars(o)) for o in owners]
    try:
        assert megatron_cpu.apply() == _names(megatron_cpu.FIXES)
        assert megatron_cpu.apply() == _names(megatron_cpu.FIXES)  # once
        changed = set(_changed(before, owners))  # moe_utils.te_general_gemm too, unless this process defined it
        assert changed >= {
            "torch.cuda.current_device", "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream",
            "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", "FP32Optimizer.__init__",
            "MixedPrecisionOptimizer.__init__", "MegatronOptimizer.get_grad_norm", "MegatronOptimizer.clip_grad_norm",
            "MegatronOptimizer.count_zeros", "ChainedOptimizer.get_grad_norm", "ChainedOptimizer.count_zeros",
            "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32", "torch.cuda.synchronize",
            "megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue"}
        megatron_cpu.remove()
        assert _changed(before, owners) == []
    finally:
        megatron_cpu.apply()  # as later tests in this process expect


WRITER = textwrap.dedent("""
    import os, signal, sys
    if __name__ == "__main__":  # the Manager is spawned: it re-runs this file, so keep the imports below
        from megatron_qarl.moe import megatron_cpu
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
        if sys.argv[1] == "fixed":
            megatron_cpu.apply()
        queue = fa._get_write_results_queue()
        print(queue._manager._process.pid, flush=True)  # the Manager's server process
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _alive_after_trainer_killed(tmp_path, mode: str) -> bool:
    """Start dist-checkpointing's results-queue Manager in a trainer, kill -9 the trainer: is the Manager alive
    10 s later? (It is killed here if so.)"""
    import time

    script = tmp_path / f"saver_{mode}.py"
    script.write_text(WRITER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / f"saver_{mode}.log"
    with log.open("w") as err:  # not a pipe: a surviving Manager inherits the trainer's stdout and stderr
        proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=err, text=True,
                                env=env)
        line = proc.stdout.readline()  # the first line only: EOF may never come while the Manager lives
        proc.wait(timeout=300)
    proc.stdout.close()
    pids = [int(p) for p in line.split()]
    assert len(pids) == 1, line + log.read_text()[-2000:]  # the trainer got as far as starting the Manager
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pids[0], 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    os.kill(pids[0], 9)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_checkpoint_writer_manager_dies_with_a_killed_trainer_and_the_fix_is_still_needed(tmp_path):
    """fix_write_results_queue: with it, the Manager dies with a trainer killed by -9; without it (upstream's
    ``ctx.Manager()``), it outlives the trainer."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # the two trainers at once: each waits 10 s for its Manager
        fixed, upstream = pool.map(lambda mode: _alive_after_trainer_killed(tmp_path, mode), ["fixed", "upstream"])
    assert not fixed, "the Manager outlived the killed trainer"
    assert upstream, \
        "upstream's Manager no longer outlives a killed trainer: remove fix_write_results_queue"


@pytest.mark.parametrize("config, overrides, asked", [
    ("cpu_default.yaml", ["launch.gpus_per_learner_rank=1"], "launch.gpus_per_learner_rank=1"),
    ("cpu_default.yaml", ["rollout.backend=sglang", "rollout.gpus_per_server=1"], "rollout.backend=sglang"),
    ("qwen3-30b-a3b/w4a16_tbpo_2x8.yaml", [],
     "launch.gpus_per_node=8, launch.gpus_per_learner_rank=1, rollout.backend=sglang"),
])
def test_a_learner_of_a_gpu_run_refuses_a_process_without_cuda(config, overrides, asked, monkeypatch, tiny_model_dir):
    """Ray hides the GPUs from an actor placed without one: such a learner rank must fail, not train on the CPU."""
    from megatron_qarl.learner.worker import LearnerWorker
    from megatron_qarl.moe import parallelize
    from megatron_qarl.preflight.rules import load_config

    def must_not_run(**_):
        raise AssertionError("init_parallel ran: the learner started building")

    monkeypatch.setattr(parallelize, "init_parallel", must_not_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cfg = load_config(REPO / "configs" / config, overrides)
    worker = LearnerWorker(cfg, 3, cfg.world_size)
    expected = (rf"learner rank 3: the config asks for GPUs \({re.escape(asked)}\) but this process sees none "
                r".*CUDA_VISIBLE_DEVICES=''\); it will not train on the CPU")
    with pytest.raises(UserError, match=expected):
        worker.setup("127.0.0.1", parallelize.free_port())
    assert worker.learner is None


def test_a_cpu_run_does_not_ask_for_gpus(tiny_model_dir):
    from megatron_qarl.preflight.rules import load_config

    assert load_config(REPO / "configs" / "cpu_default.yaml").gpu_run_keys == []


def _host_reads(fn, *args) -> tuple[object, int]:
    """fn(*args) and the host reads its aten ops made (tests/test_learner_launches.py's count)."""
    from test_learner_launches import Count

    with Count() as c:
        out = fn(*args)
    return out, c.syncs


def _grads(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * scale for shape, scale in
            (((64, 32), 1e-3), ((7,), 1.0), ((3, 5, 11), 1e2), ((1,), 1e-8), ((128, 128), 3e-2))]


def test_fix_multi_tensor_fallbacks_gives_megatrons_grad_norm_bit_for_bit_without_a_host_read():
    """Issue 48: Megatron's local l2 norm (what clip_grads.py binds without TE and Apex) reads the host once per tensor
    and once more (``torch.tensor([torch.norm(t) ...])``, ``float(...)``); foreach_l2_norm gives the same float32
    bits with no host read, for one dtype and for mixed ones."""
    from megatron.core import utils as mutils

    for grads in (_grads(), [*_grads(1)[:3], _grads(2)[4].bfloat16()]):
        with megatron_cpu._CudaAllocationsOnCpu():  # Megatron's returns a device='cuda' tensor
            (upstream, _), upstream_reads = _host_reads(mutils.local_multi_tensor_l2_norm, 0, None, [grads], False)
        (ours, _), reads = _host_reads(megatron_cpu.foreach_l2_norm, 0, None, [grads], False)
        # upstream's per-tensor reads happen inside torch.tensor's C++ conversion, which no dispatch mode sees (on
        # CUDA each is a device-to-host copy); its float() of the total is the one counted here
        assert upstream_reads >= 1 and reads == 0, (upstream_reads, reads)
        assert ours.dtype == upstream.dtype == torch.float32 and ours.shape == upstream.shape == (1,)
        assert torch.equal(ours, upstream), (ours, upstream)


@pytest.mark.parametrize("case", ["in place", "copy and cast", "copy at 1.0"])
def test_fix_multi_tensor_fallbacks_scales_and_clips_bit_for_bit(case):
    """foreach_scale equals Megatron's local multi_tensor_scale (dst <- src x scale) bit for bit: in place (what
    clipping does), into other tensors of another dtype (the main params copied to the bf16 model params), at 1.0;
    and the CPU clip (fix_clip_grads, now one _foreach_mul_) equals the per-tensor rule g <- g x max_norm / (norm +
    1e-6)."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import optimizer as opt

    src, scale = _grads(), {"in place": 0.37, "copy and cast": 0.81, "copy at 1.0": 1.0}[case]
    dtype = torch.bfloat16 if case == "copy and cast" else torch.float32

    def lists():
        a = [t.clone() for t in src]
        return [a, a] if case == "in place" else [a, [torch.empty_like(t, dtype=dtype) for t in a]]

    upstream, ours = lists(), lists()
    mutils.local_multi_tensor_scale(0, None, upstream, scale)
    _, reads = _host_reads(megatron_cpu.foreach_scale, 0, None, ours, scale)
    assert reads == 0 and all(torch.equal(a, b) for a, b in zip(upstream[1], ours[1], strict=True))

    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in src]
    for p, g in zip(params, src, strict=True):
        p.grad = g.clone()
    norm = float(megatron_cpu.foreach_l2_norm(0, None, [src], False)[0])
    megatron_cpu.apply()
    _, reads = _host_reads(opt.clip_grad_by_total_norm_fp32, params, 1e-2, norm)
    coeff = 1e-2 / (norm + 1.0e-6)
    assert reads == 0 and all(torch.equal(p.grad, g * coeff) for p, g in zip(params, src, strict=True))


def test_fix_torch_adam_steps_within_ulps_of_torchs_for_loop_and_the_same_bits_for_a_shard():
    """Megatron's fallback Adam is torch.optim.AdamW with neither foreach nor fused: torch's for-loop on CPU (its
    foreach on CUDA: torch/optim/optimizer.py ``_default_to_fused_or_foreach``), each step reading every
    parameter's step counter to the host. The fused AdamW (use_fused_adam) reads none, steps within 8 ulps (of each
    parameter, or of its updates where it is smaller) of the for-loop over 5 steps, and gives an element the same
    bits whether its parameter is whole or a shard of it (tensor-parallel runs compare with single-rank ones)."""
    torch.manual_seed(0)
    start = [torch.randn(67, 33), torch.randn(1000)]

    def run(fused: bool, tensors=start) -> tuple[list[torch.Tensor], int]:
        params = [torch.nn.Parameter(t.clone()) for t in tensors]
        adam = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)

        class Wrapped:  # what Megatron's optimizers hold: the torch optimizer as .optimizer
            optimizer = adam

        if fused:
            assert megatron_cpu.use_fused_adam(Wrapped) == 1
        reads = 0
        for i in range(5):
            for p in params:
                p.grad = torch.sin(p.detach() * (i + 1))
            reads += _host_reads(adam.step)[1]
        return [p.detach() for p in params], reads

    (loop, loop_reads), (fused, fused_reads) = run(False), run(True)
    assert loop_reads == 5 * len(start) and fused_reads == 0, (loop_reads, fused_reads)
    for a, b in zip(loop, fused, strict=True):  # in ulps of the parameter or of the 5 updates of lr, the larger
        ulp = torch.finfo(torch.float32).eps * torch.maximum(a.abs(), torch.tensor(5 * 1e-3))
        print(f"fused vs for-loop: {float(((a - b).abs() / ulp).max()):.2f} ulps")
        assert float(((a - b).abs() / ulp).max()) <= 8
    shard, _ = run(True, [start[1][123:456]])
    assert torch.equal(shard[0], fused[1][123:456])


def test_fused_adam_stays_on_across_a_load_of_a_checkpoint_written_without_it():
    """A checkpoint's param groups replace the live ones on load (torch's and Megatron's load_state_dict), ``fused``
    with them: a state written by the for-loop Adam (fused None, step counters on the CPU) loaded into a fused one
    turns it back on with each step counter where the fused kernel reads it (float32, the parameter's device), and
    its next step reads the host nowhere."""
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2)]
    old = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    old.step()
    saved = old.state_dict()
    assert saved["param_groups"][0]["fused"] is None

    adam = torch.optim.AdamW(params, lr=1e-3)

    class Wrapped:
        optimizer = adam

    assert megatron_cpu.use_fused_adam(Wrapped) == 1
    adam.load_state_dict(saved)
    assert adam.param_groups[0]["fused"] is True and adam.param_groups[0]["foreach"] is False
    assert all(s["step"].dtype == torch.float32 and s["step"].device == p.device for p, s in adam.state.items())
    assert _host_reads(adam.step)[1] == 0 and all(float(s["step"]) == 2.0 for s in adam.state.values())
    step = megatron_cpu.adam_step(3, adam.param_groups[0], params[0])
    assert step.dtype == torch.float32 and step.device == params[0].device and float(step) == 3.0
