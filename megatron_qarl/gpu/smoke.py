"""The GPU machine check behind scripts/gpu_smoke.sh (``python -m megatron_qarl.gpu.smoke report|simulate|smoke``).

``report``: what this machine offers (CUDA devices, NCCL, Transformer Engine and its FP8 block-scale format,
SGLang, the torch.distributed backend the learner would pick). ``simulate``: the learner checks below on a simulated
CUDA device (``simulated_device``: any machine without CUDA, or with the GPUs hidden), so that a CPU tensor mixed
into device arithmetic is found before GPU time is spent, plus ``simulated_equals_cpu``. ``smoke``: every check it
can run on the real GPU, sized for a short lease on one GPU (about a minute of work on an H200 for the tiny model):

- ``fp8_gemm``: FP8 GEMMs on the tensor cores: SGLang's block recipe (1 x 128 activation groups, 128 x 128 weight
  blocks, fp32 scales) computed from our quantizer's codes with ``torch._scaled_mm`` per 128-wide K block, against
  the same operands dequantized and multiplied in fp32; with Transformer Engine also TE's Float8BlockScaling GEMM of
  the same bf16 operands, against the bf16 product and against the SGLang-recipe result.
- ``triton_refresh``, ``torch_refresh``: the learner's refresh kernels (qat/triton_refresh.py, what
  ``learner.refresh_kernel`` auto runs on CUDA) compiled on this GPU, and the torch path on it, each bit for bit
  against the reference quantizer on the CPU (reported apart: a torch op on CUDA could differ where the kernels
  do not).
- ``LEARNER_CHECKS[impl,scheme]`` (``learner_checks``): a TP1/EP1 ``Learner`` on CUDA for each quant scheme (bf16,
  w4a16, w8a8_fp8, w8a8_int8), impl "local" always, "te" too where Transformer Engine is installed: build and load
  the tiny model, its first (aligned) forward, the weight-sync payload (what a sync sends SGLang) broadcast over an
  NCCL group of world size 1, which rejects CPU tensors as a real weight-update group does (the failures name the
  tensors), a train step, an R3 train step (routes replayed), the delta encoder, a checkpoint save. On the TE spec
  the quantized schemes' GEMMs run in BF16 on ModelOpt's fake-quant operands, w8a8_fp8 too (docs/quantization.md,
  "FP8 on the TE spec"): its ``forward[te,w8a8_fp8]`` is the first forward that ModelOpt's TE plugin refused under
  fp8 autocast.
- ``te_fp8[te,bf16]``, ``te_fp8[te,w4a16]`` (Transformer Engine only): ``model.te_fp8``, a learner whose TE GEMMs
  run TE's blockwise FP8 recipe (w4a16: the experts' fake-quant GEMMs with fp8 autocast off inside, attention in
  FP8): its first forward and a train step; for w4a16 also how far its log-probs are from the same learner's with
  BF16 attention (docs/quantization.md, "FP8 on the TE spec").
- ``nccl_broadcast``: a 4 MiB NCCL broadcast from GPU 0 to every visible GPU (one process each).

On a machine without CUDA it says so and exits 0. The GPU code it checks lives with its concept: the Transformer
Engine model in ``moe/te.py`` (built by ``moe.model.build_model(..., te=True)``), the backend choice in
``moe/parallelize.py``, the SGLang command in ``rollout/sglang_launcher.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megatron_qarl.qat.config import SCHEMES, QuantConfig

# the committed tiny checkpoint, relative to a checkout's root (scripts/gpu_smoke.sh runs from there)
TINY_MODEL = Path("checkpoints") / "tiny-qwen3-moe"
NO_CUDA = "skipped: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check"


def report() -> dict[str, Any]:
    """What this machine offers: CUDA devices, NCCL, Transformer Engine, SGLang."""
    import torch

    from megatron_qarl.moe.parallelize import dist_backend
    from megatron_qarl.moe.te import prefer_fp32_block_scales, te_fp8_block_scales, transformer_engine_available
    from megatron_qarl.rollout.sglang_launcher import sglang_available

    prefer_fp32_block_scales()  # before anything imports TE, as in a learner process
    cuda = torch.cuda.is_available()
    te = transformer_engine_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "nccl": bool(cuda and torch.distributed.is_nccl_available()),
        "transformer_engine": te,
        "te_fp8_block_scales": te_fp8_block_scales() if te else None,
        "sglang": sglang_available(),
        "backend": dist_backend(),
    }


# ---------------------------------------------------------------------------------------------------- FP8 GEMMs
def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _fp8_gemm(te: bool) -> dict[str, float]:
    """SGLang's block-FP8 GEMM from our codes on the tensor cores (torch._scaled_mm), and TE's when installed."""
    import torch

    from megatron_qarl.qat.quantizer import (
        dequant_act_fp8_per_token_group,
        dequantize_fp8_block,
        quant_act_fp8_per_token_group,
        quantize_fp8_block,
    )

    torch.manual_seed(0)
    m, n, k, b = 256, 512, 1024, 128
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    qw = quantize_fp8_block(w, b)
    qa, sa = quant_act_fp8_per_token_group(x, b)
    ref = dequant_act_fp8_per_token_group(qa, sa, torch.float32) @ dequantize_fp8_block(qw, torch.float32).t()
    one = torch.ones((), device="cuda", dtype=torch.float32)
    out = torch.zeros(m, n, device="cuda", dtype=torch.float32)
    s_w = qw.scales.repeat_interleave(b, dim=0)[:n]  # [N, K/B]: each output row's block scale per K block
    for kb in range(k // b):
        a_blk = qa[:, kb * b:(kb + 1) * b].contiguous()
        w_blk = qw.codes[:, kb * b:(kb + 1) * b].contiguous().t()  # [B, N], column-major as _scaled_mm wants
        part = torch._scaled_mm(a_blk, w_blk, scale_a=one, scale_b=one, out_dtype=torch.float32)
        out += part * sa[:, kb:kb + 1] * s_w[:, kb][None, :]
    torch.cuda.synchronize()
    result = {"scaled_mm_vs_fp32_dequant_rel": _rel(out, ref)}
    if result["scaled_mm_vs_fp32_dequant_rel"] > 1e-3:
        raise RuntimeError(f"block-FP8 GEMM from our codes differs from the dequantized product: {result}")
    if te:
        import transformer_engine.pytorch as te_pt
        from transformer_engine.common.recipe import Float8BlockScaling

        lin = te_pt.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            lin.weight.copy_(w)
        autocast = getattr(te_pt, "autocast", None)
        ctx = (autocast(enabled=True, recipe=Float8BlockScaling()) if autocast is not None
               else te_pt.fp8_autocast(enabled=True, fp8_recipe=Float8BlockScaling()))
        with torch.no_grad(), ctx:
            y = lin(x)
        torch.cuda.synchronize()
        result["te_block_fp8_vs_bf16_rel"] = _rel(y, x.float() @ w.float().t())
        result["te_block_fp8_vs_sglang_recipe_rel"] = _rel(y, out)
        if result["te_block_fp8_vs_bf16_rel"] > 0.1:
            raise RuntimeError(f"TE's block-FP8 GEMM is far from the bf16 product: {result}")
    return result


# ------------------------------------------------------------------------------------ learner step + sync payload
# the checks of one learner, in order (each entry of learner_checks is one of these, suffixed [impl,scheme])
LEARNER_CHECKS = ("build", "forward", "sync_payload", "train_step", "r3_train_step", "delta", "checkpoint")


# which check each one needs to have passed first
_NEEDS = {"build": None, "forward": "build", "sync_payload": "forward", "train_step": "forward",
          "r3_train_step": "forward", "delta": "sync_payload", "checkpoint": "build"}


class _LearnerCheck:
    """The checks of one learner (``LEARNER_CHECKS``, one method each, in order) and the state they share."""

    def __init__(self, model_dir: str, impl: str, scheme: str, workdir: str, simulated: bool):
        import torch

        from megatron_qarl.moe.model import Qwen3MoeArch

        self.model_dir, self.impl, self.scheme, self.workdir = model_dir, impl, scheme, workdir
        self.simulated = simulated
        torch.manual_seed(0)
        self.arch = Qwen3MoeArch.from_model_dir(model_dir)
        rows, seq = (2, 16) if simulated else (4, 128)  # FP8 GEMMs want token counts in multiples of 16 (TE: 128)
        self.tokens = torch.randint(0, self.arch.vocab_size, (rows, seq))
        self.mask = torch.ones(rows, seq - 1)
        self.learner = self.before = None

    def build(self) -> str:
        import torch

        from megatron_qarl.config import OptimConfig, ParallelConfig
        from megatron_qarl.learner.rank import Learner

        learner = Learner(self.arch, ParallelConfig(), OptimConfig(lr=1e-4), dtype=torch.bfloat16,
                          quant=QuantConfig(scheme=self.scheme), aligned=True, impl=self.impl, routing_replay=True)
        learner.load_hf(self.model_dir)
        if learner.device.type != "cuda":
            raise RuntimeError(f"the learner's parameters are on {learner.device}, not CUDA")
        self.learner = learner
        return f"{sum(p.numel() for p in learner.module.parameters())} parameters on {learner.device}"

    def forward(self) -> str:
        import torch

        logp = self.learner.forward_logprobs(self.tokens)
        if not torch.isfinite(logp).all():
            raise RuntimeError("non-finite aligned log-probs")
        return f"mean logp {float(logp.mean()):.4f}"

    def sync_payload(self) -> str:
        self.before, nbytes = _payload(self.learner, self.simulated)
        return f"{len(self.before)} tensors, {nbytes / 2**20:.2f} MiB"

    def train_step(self, routes: bool = False) -> str:
        import torch

        from megatron_qarl.learner.rank import Batch, token_mean_nll

        learner, tokens, extra, total = self.learner, self.tokens, {}, int(self.mask.sum())
        if routes:  # the routes a server would return; the aligned forward replaying them gives the same log-probs
            logp, extra["routes_BSLK"] = learner.forward_routes(tokens)
            if not torch.equal(learner.forward_logprobs(tokens, extra["routes_BSLK"]), logp):
                raise RuntimeError("the aligned forward replaying its own routes changed the log-probs")
        metrics = learner.train_step(Batch(tokens, self.mask, extra), lambda lp, b: token_mean_nll(lp, b, total))
        torch.cuda.synchronize()
        if metrics["skipped"] != 0.0:
            raise RuntimeError(f"non-finite step: {metrics}")
        return f"loss {metrics['loss']:.4f}, grad_norm {metrics['grad_norm']:.4f}"

    def r3_train_step(self) -> str:
        return self.train_step(routes=True)

    def delta(self) -> str:
        after, _ = _payload(self.learner, self.simulated)
        return _delta_roundtrip(self.before, after)

    def checkpoint(self) -> str:
        from megatron_qarl.learner.checkpoint import save_learner

        path = Path(self.workdir) / f"checkpoint-{self.impl}-{self.scheme}"
        save_learner(path, self.learner.module, self.learner.optimizer)
        return f"{sum(f.stat().st_size for f in path.rglob('*') if f.is_file()) / 2**20:.2f} MiB"


def learner_checks(model_dir: str, impl: str, scheme: str, workdir: str, *, simulated: bool = False) -> dict[str, str]:
    """One TP1/EP1 learner for ``scheme`` on the current CUDA device (real, or ``simulated_device.simulated_cuda``),
    built with routing replay and the rollout-aligned fake quant, checked step by step; one entry per check,
    suffixed ``[impl,scheme]``: ``forward`` (the aligned log-probs), ``sync_payload`` (what a sync sends SGLang,
    broadcast through a weight-update group of world size 1, which refuses tensors not on the GPU as NCCL does),
    ``train_step`` (routers routing on their own), ``r3_train_step`` (R3: the routes of ``forward_routes`` replayed by
    the aligned forward, which must give the same log-probs, then by ``train_step``), ``delta`` (the delta encoder
    between the payloads before and after the two steps, applied back bit for bit), ``checkpoint`` (a
    dist-checkpoint save). A check whose prerequisite failed is skipped, saying so."""
    key = f"[{impl},{scheme}]"
    run = _LearnerCheck(model_dir, impl, scheme, workdir, simulated)
    steps = {"build": run.build, "forward": run.forward, "sync_payload": run.sync_payload,
             "train_step": run.train_step, "r3_train_step": run.r3_train_step, "delta": run.delta,
             "checkpoint": run.checkpoint}
    assert tuple(steps) == tuple(_NEEDS) == LEARNER_CHECKS
    checks: dict[str, str] = {}
    for name, fn in steps.items():
        needs = _NEEDS[name]
        if needs is not None and not checks.get(needs + key, "").startswith("ok"):
            checks[name + key] = f"skipped: {needs} failed"
        else:
            checks[name + key] = _timed(fn)
    return checks  # the learner goes with ``run``, before the next one is built


def _timed(fn, *args) -> str:
    """``ok: <what fn says>, <seconds>`` or ``FAILED: <error>``."""
    t0 = time.perf_counter()
    try:
        return f"ok: {fn(*args)}, {time.perf_counter() - t0:.1f}s"
    except Exception as err:  # noqa: BLE001 - report every check, then fail at the end
        return f"FAILED: {type(err).__name__}: {err}"


def _payload(learner, simulated: bool) -> tuple[dict, int]:
    """The learner's sync payload (name -> tensor, copied), every tensor broadcast through a weight-update group of
    world size one over NCCL (simulated: ``simulated_device``), which refuses tensors that are not on the GPU."""
    import datetime

    import torch.distributed as dist

    from megatron_qarl.moe.parallelize import broadcast, group_device, to_group_device
    from megatron_qarl.sync.payload import iter_sync_tensors

    # a weight-update group of one (simulated: a gloo group standing in for NCCL, which refuses CPU tensors too)
    group = dist.new_group(ranks=[0], backend=None if simulated else "nccl", timeout=datetime.timedelta(seconds=120))
    out, refused, nbytes = {}, [], 0
    try:
        for name, tensor in iter_sync_tensors(learner):
            if tensor.device != group_device(group):  # what NCCL would refuse (to_group_device would move it)
                refused.append(f"{name} ({tensor.device})")
                continue
            try:
                broadcast(to_group_device(tensor, group), src=0, group=group, name=name)
            except Exception as err:  # noqa: BLE001 - name every tensor NCCL refuses
                refused.append(f"{name} ({tensor.device}: {type(err).__name__})")
                continue
            out[name] = tensor.clone()
            nbytes += tensor.numel() * tensor.element_size()
    finally:
        dist.destroy_process_group(group)
    if refused:
        raise RuntimeError(f"{len(refused)} of {len(out) + len(refused)} tensors not on the GPU: {refused[:4]}")
    return out, nbytes


def _delta_roundtrip(before: dict, after: dict) -> str:
    """sync.delta between two payloads, on their device: every changed tensor's delta applied to the old one gives
    the new one bit for bit."""
    from megatron_qarl.sync import delta

    changed = sent = 0
    for name, new in after.items():
        d = delta.diff(name, before[name], new)
        if d is None:
            continue
        held = before[name].clone()
        delta.apply(held, d.index, d.values)
        if not held.view(-1).view(delta._INT[held.element_size()]).equal(
                new.reshape(-1).view(delta._INT[new.element_size()])):
            raise RuntimeError(f"{name}: the delta applied to the old tensor does not give the new one")
        changed += 1
        sent += sum(t.numel() * t.element_size() for _, t in d.wire())
    if not changed:
        raise RuntimeError("two optimizer steps changed no tensor of the payload")
    return f"{changed} of {len(after)} tensors changed, {sent / 2**10:.1f} KiB of deltas"


TE_FP8_SCHEMES = ("bf16", "w4a16")  # the schemes model.te_fp8 runs with (moe.te.check_te_fp8)


def te_fp8_check(model_dir: str, scheme: str) -> str:
    """``model.te_fp8``: a TE-spec learner whose TE GEMMs run TE's blockwise FP8 recipe (real CUDA with Transformer
    Engine only); its first forward under fp8 autocast and a train step. With w4a16 the experts' fake-quant GEMMs
    run with fp8 autocast off inside (qat/modules.py), attention in FP8: the mean |logp| difference to the same
    learner without model.te_fp8 (BF16 attention, what the rollout computes) is the trade-off's size."""
    import torch

    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.moe.model import Qwen3MoeArch

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    torch.manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (4, 128))  # TE blockwise FP8: token counts in multiples of 128
    mask = torch.ones(4, 127)

    def learner(fp8: bool):
        built = Learner(arch, ParallelConfig(), OptimConfig(lr=1e-4), dtype=torch.bfloat16,
                        quant=QuantConfig(scheme=scheme), impl="te", te_fp8=fp8)
        built.load_hf(model_dir)
        return built

    fp8 = learner(True)
    logp = fp8.forward_logprobs(tokens)
    metrics = fp8.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, int(mask.sum())))
    torch.cuda.synchronize()
    if not (torch.isfinite(logp).all() and metrics["skipped"] == 0.0):
        raise RuntimeError(f"non-finite FP8 step: {metrics}")
    out = f"mean logp {float(logp.mean()):.4f}, loss {metrics['loss']:.4f}"
    if scheme != "bf16":
        del fp8
        gap = (logp - learner(False).forward_logprobs(tokens)).abs().mean()
        out += f", mean |logp - the BF16-attention learner's| {float(gap):.2e}"
    return out


def _learner_all(model_dir: str, impls: list[str], checks: dict[str, str], workdir: str) -> None:
    from megatron_qarl.moe.parallelize import destroy_parallel, init_parallel, single_rank_env

    single_rank_env()
    init_parallel(tp=1, ep=1)
    try:
        for impl in impls:
            for scheme in SCHEMES:
                checks.update(learner_checks(model_dir, impl, scheme, workdir))
        if "te" in impls:
            for scheme in TE_FP8_SCHEMES:
                checks[f"te_fp8[te,{scheme}]"] = _timed(te_fp8_check, model_dir, scheme)
    finally:
        destroy_parallel()


def simulate(model_dir: str, workdir: str) -> dict[str, Any]:
    """The learner checks of ``smoke`` on a simulated CUDA device (``simulated_device``; local spec, every scheme,
    gloo world of one), plus ``simulated_equals_cpu``: the w4a16 learner's log-probs, loss and gradient norm on the
    simulated device equal the CPU run's bit for bit (the simulation changes nothing but the device check)."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_qarl.gpu.simulated_device import simulated_cuda
    from megatron_qarl.moe.parallelize import COLLECTIVE_TIMEOUT_S, destroy_parallel, init_parallel, single_rank_env

    single_rank_env()
    # the simulated GPU has no NCCL: its groups are gloo (module docstring); a world of one, bounded all the same
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    checks: dict[str, str] = {}
    try:
        with simulated_cuda():
            init_parallel(tp=1, ep=1)
            for scheme in SCHEMES:
                checks.update(learner_checks(model_dir, "local", scheme, workdir, simulated=True))
            t0 = time.perf_counter()
            sim = _cpu_comparable_step(model_dir)
            ps.destroy_model_parallel()  # Megatron's global buffers hold device tensors
        init_parallel(tp=1, ep=1)
        cpu = _cpu_comparable_step(model_dir)
        same = all(_bitwise_equal(sim[k], cpu[k]) for k in cpu)
        checks["simulated_equals_cpu[local,w4a16]"] = (
            f"ok: log-probs, loss and grad norm bit-identical, {time.perf_counter() - t0:.1f}s" if same else
            f"FAILED: simulated {({k: _summary(v) for k, v in sim.items()})} vs CPU "
            f"{({k: _summary(v) for k, v in cpu.items()})}")
    finally:
        destroy_parallel()
    return {"device": "simulated CUDA (megatron_qarl.gpu.simulated_device)", "checks": checks}


def _cpu_comparable_step(model_dir: str) -> dict:
    """An fp32 w4a16 learner's aligned log-probs, then one train step: on whatever device the process has."""
    import torch

    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.moe.model import Qwen3MoeArch

    torch.manual_seed(0)
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    tokens = torch.randint(0, arch.vocab_size, (2, 16))
    mask = torch.ones(2, 15)
    learner = Learner(arch, ParallelConfig(), OptimConfig(lr=1e-3), quant=QuantConfig(scheme="w4a16"))
    learner.load_hf(model_dir)
    logp = learner.forward_logprobs(tokens)
    metrics = learner.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, 30))
    after = learner.forward_logprobs(tokens)
    return {"logp": logp, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "logp_after_step": after}


def _bitwise_equal(a, b) -> bool:
    import torch

    return torch.equal(a.cpu(), b.cpu()) if torch.is_tensor(a) else a == b


def _summary(v) -> str:
    import torch

    return f"mean {float(v.mean()):.9g}" if torch.is_tensor(v) else f"{v:.9g}"


def same_bits(a, b) -> bool:
    """Two tensors (any devices; or both None) of the same shape and dtype holding the same bits (nan payloads and
    -0 included, where ``torch.equal`` compares values)."""
    import torch

    if a is None or b is None:
        return a is b
    def raw(t):
        return t.detach().cpu().contiguous().view(torch.uint8)

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def refresh_differences(ref: tuple, got: tuple) -> list[str]:
    """The fields of ``got`` = (QuantizedWeight, dequantized weight) whose shape, dtype or bits differ from ``ref``'s:
    "codes", "scales", "zero_points", "dequantized"."""
    fields = [f for f in ("codes", "scales", "zero_points") if not same_bits(getattr(ref[0], f), getattr(got[0], f))]
    return fields + ([] if same_bits(ref[1], got[1]) else ["dequantized"])


def _refresh_vs_cpu(path: str) -> str:
    """The learner's refresh on this GPU (``path`` "triton": the kernels of qat/triton_refresh.py, what
    ``learner.refresh_kernel`` auto runs on CUDA; "torch": the reference ops on the GPU) against the reference
    quantizer on the CPU, bit for bit: codes, scales, zero points and the dequantized weight, every scheme (W4A16
    symmetric, asymmetric and with bf16-rounded products too), from fp32 and bf16 masters, finite weights with zero,
    tiny (subnormal scales), tie and huge rows."""
    import torch

    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.quantizer import fake_quantize_weight

    if path == "triton":
        import triton

        from megatron_qarl.qat.triton_refresh import fake_quantize_triton as refresh
        version = f"triton {triton.__version__}"
    else:
        def refresh(x, cfg):
            return fake_quantize_weight(x, cfg, check_finite=False)
        version = f"torch {torch.__version__}"

    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 2304, generator=g) * 0.02
    w[0], w[1] = 0.0, torch.arange(2304) % 17 - 8.0
    w[2] *= 1e-37
    w[3] = 1e30
    variants = [dict(scheme="w4a16"), dict(scheme="w4a16", symmetric=False), dict(scheme="w4a16", scale_bits=None),
                dict(scheme="w8a8_fp8"), dict(scheme="w8a8_int8")]
    differ, n = [], 0
    for kwargs in variants:
        cfg = QuantConfig(**kwargs)
        for dtype in (torch.float32, torch.bfloat16):
            x = w.to(dtype)
            got = refresh(x.cuda(), cfg)
            n += 1
            differ += [f"{kwargs} {dtype} {field}"
                       for field in refresh_differences(fake_quantize_weight(x, cfg, check_finite=False), got)]
    if differ:
        raise AssertionError(f"{version}: {len(differ)} of {n * 4} fields differ from the CPU reference: {differ[:8]}")
    return f"{version}: {n} refreshes bit-equal to the CPU reference"


def _broadcast_rank(rank: int, world: int, port: int, q) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_qarl.moe.parallelize import broadcast, to_group_device

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # its join(timeout=120) is the caller's bound
    try:
        t = to_group_device(torch.full((1 << 20,), float(rank == 0) * 3.0))
        broadcast(t, 0, name="smoke tensor")
        torch.cuda.synchronize()
        q.put((rank, float(t.min()), float(t.max())))
    finally:
        dist.destroy_process_group()


def _nccl_broadcast() -> dict[str, Any]:
    """A 4 MiB NCCL broadcast from GPU 0 to every visible GPU (one process each; 1 GPU: a group of one)."""
    import torch
    import torch.multiprocessing as mp

    from megatron_qarl.moe.parallelize import free_port

    world = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    results = sorted(q.get(timeout=5) for _ in range(world))
    if any(p.exitcode != 0 for p in procs) or any((lo, hi) != (3.0, 3.0) for _, lo, hi in results):
        raise RuntimeError(f"NCCL broadcast failed: exit codes {[p.exitcode for p in procs]}, got {results}")
    return {"ranks": world, "bytes": 4 << 20}


def model_dir(path: str | None) -> str:
    """The tiny checkpoint the learner checks load: ``--model``, else checkpoints/tiny-qwen3-moe of the working
    directory (a checkout); an error naming the flag when neither holds a config.json."""
    chosen = Path(path) if path else TINY_MODEL
    if not (chosen / "config.json").is_file():
        raise SystemExit(f"--model: {chosen} holds no config.json (run from a checkout of the repository, or pass "
                         "--model DIR with a Hugging Face Qwen3-MoE checkpoint such as checkpoints/tiny-qwen3-moe)")
    return str(chosen)


def smoke(model: str | None = None) -> dict[str, Any]:
    """Run every check this machine can; each result is "ok: ...", "skipped: why" or "FAILED: error"."""
    info = report()
    out: dict[str, Any] = {"machine": info}
    if not info["cuda"]:
        out["checks"] = {"all": NO_CUDA}
        return out
    checks: dict[str, str] = {}
    te = info["transformer_engine"]
    checks["fp8_gemm"] = _timed(_fp8_gemm, te)
    checks["triton_refresh"] = _timed(_refresh_vs_cpu, "triton")
    checks["torch_refresh"] = _timed(_refresh_vs_cpu, "torch")
    impls = ["local", "te"] if te else ["local"]
    try:
        with tempfile.TemporaryDirectory() as workdir:
            _learner_all(model_dir(model), impls, checks, workdir)
    except Exception as err:  # noqa: BLE001 - e.g. the process group cannot form
        checks["learner"] = f"FAILED: {type(err).__name__}: {err}"
    if not te:
        checks["learner[te,*]"] = "skipped: transformer_engine not installed (the local spec ran)"
    checks["nccl_broadcast"] = _timed(_nccl_broadcast)
    checks["sglang"] = "ok: importable" if info["sglang"] else "skipped: sglang not installed"
    out["checks"] = checks
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_qarl.gpu.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["report", "smoke", "simulate"],
                        help="report: the machine; smoke: the real CUDA checks; simulate: the learner checks on a "
                             "simulated CUDA device (any machine without CUDA, seconds)")
    parser.add_argument("--model", help="the tiny Qwen3-MoE checkpoint (default: checkpoints/tiny-qwen3-moe)")
    args = parser.parse_args(argv)
    if args.command == "report":
        print(json.dumps(report(), indent=2))
        return 0
    t0 = time.perf_counter()
    if args.command == "simulate":
        with tempfile.TemporaryDirectory() as workdir:
            result = simulate(model_dir(args.model), workdir)
    else:
        result = smoke(args.model)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=2), flush=True)
    return 1 if any(str(v).startswith("FAILED") for v in result["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
