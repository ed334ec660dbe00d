"""The W8A8 flip model (issue 47): where a W8A8 learner and the embedded server part, and by how much.

Both sides quantize each quantized linear's input per token (group) with the same formula
(``qat.quantizer``), round to nearest. Their float32 arithmetic before that rounding differs in order (the
learner's GEMMs are MKL's sgemm at M = batch x sequence, the server's the native low-bit kernels at M = 1), so
now and then one element lands on the other side of a rounding boundary: one activation code differs by one
step (a *flip*). A flip moves that operand by a whole code step, not by an ulp: for e4m3, 2^(e - 3) x the group
scale amax / 448, i.e. 32/448 of the amax in the top binade [256, 448]; for int8, amax / 127.

The model: (1) everything the two sides differ by, beyond float32 rounding, comes from the activation codes:
the learner fed the server's codes and scales (``fed``: each input quantizer returns the server's quantized
operand for the same token) agrees with the server within the float32 bound FP32_TOKEN on every token; and (2)
a token with no flip upstream (at its position or before, in any layer) agrees within FP32_TOKEN as it is. A
defect of the weights or scales (a wrong scale on one expert) breaks (1) wherever that expert was routed, flips
or not.

``agreement`` runs the two sides in one process on the same sampled sequences, on the server's routes (R3,
as the trainer scores them): the embedded engine's model (``serve/model.py``, batch-1 prefill then decode, its
real kernels) samples and records the input of every quantized linear (``Fp8Linear`` / ``Int8Linear``
``prepare``: the native kernels quantize it inside with the same formula, bit for bit, tests/test_rollout_native.py);
the learner (Megatron, one rank) records its input quantizers' inputs, and runs once more fed the server's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "checkpoints" / "tiny-qwen3-moe"
KINDS = ("qkv", "o", "gate_up", "down")  # the quantized linears' inputs of a layer, in the order they run
# a code difference is a primary flip where the two rows over their amax agree to this (float32 rounding: measured
# <= 2e-6 on rows with no flip upstream); above it the row already carries an upstream flip's effect
PRIMARY_REL = 1e-5


@dataclasses.dataclass
class Sampled:
    """One sequence the server sampled: its tokens, the sampler's log-probs of the response tokens, the routes
    of every position it ran (int64 [len - 1, L, K]), and each quantized linear's input per position:
    (layer, kind) -> [len - 1, K_in] (qkv, o, gate_up) or [len - 1, topk, K_in] (down: per routed slot)."""

    tokens: list[int]
    prompt_len: int
    logp: list[float]
    routes: Tensor
    inputs: dict[tuple[int, str], Tensor]


def codes(x: Tensor, scheme: str, group: int) -> tuple[Tensor, Tensor]:
    """(codes as float32 values [..., K], scales [..., K/G]) of the W8A8 activation formula (per token, per group
    of ``group`` for FP8; per token for INT8)."""
    from megatron_qarl.qat.quantizer import quant_act_fp8_per_token_group, quant_act_int8_per_token

    if scheme == "w8a8_fp8":
        q, s = quant_act_fp8_per_token_group(x, group)
        return q.float(), s
    q, s = quant_act_int8_per_token(x)
    return q.float(), s


def code_steps(a: Tensor, b: Tensor, scheme: str) -> Tensor:
    """How many code steps apart two code tensors are, elementwise (e4m3: the distance in the ordered codes;
    int8: the integer difference)."""
    if scheme != "w8a8_fp8":
        return (a - b).abs()

    def ordinal(c: Tensor) -> Tensor:  # e4m3 codes as integers in value order (sign-magnitude -> two's complement)
        u = c.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
        return torch.where(u >= 128, -(u - 128), u)

    return (ordinal(a) - ordinal(b)).abs().float()


# ------------------------------------------------------------------------------------------------ the server
@contextlib.contextmanager
def _server_recording(model) -> list:
    """Record (layer, kind, input) of every quantized linear's ``prepare`` while inside."""
    from megatron_qarl.serve.kernels.linear import Fp8Linear, Int8Linear

    kinds = {}
    for layer in model.layers:
        kinds[id(layer.qkv)], kinds[id(layer.o)] = (layer.index, "qkv"), (layer.index, "o")
        for lin in layer.gate_up:
            kinds[id(lin)] = (layer.index, "gate_up")
        for lin in layer.down:
            kinds[id(lin)] = (layer.index, "down")
    calls: list = []
    originals = {cls: cls.prepare for cls in (Fp8Linear, Int8Linear)}

    def wrap(original):
        def prepare(self, x_TK):
            if id(self) in kinds:
                calls.append((*kinds[id(self)], x_TK.detach().float().clone()))
            return original(self, x_TK)
        return prepare

    for cls, original in originals.items():
        cls.prepare = wrap(original)
    try:
        yield calls
    finally:
        for cls, original in originals.items():
            cls.prepare = original


def _per_position(calls: list, routes_TLK: Tensor) -> dict[tuple[int, str], Tensor]:
    """One forward's recorded inputs by (layer, kind): [T, K_in]; the experts' down inputs [T, topk, K_in] in the
    routes' slot order (the engine concatenates them by ascending expert, tokens ascending within one)."""
    out = {}
    for layer, kind, x in calls:
        if kind != "down":
            out[(layer, kind)] = x
            continue
        idx = routes_TLK[:, layer]  # [T, topk]
        rows = [(int(e), t, k) for e in sorted(set(idx.flatten().tolist()))
                for t in range(idx.shape[0]) for k in range(idx.shape[1]) if int(idx[t, k]) == e]
        down = torch.empty(idx.shape[0], idx.shape[1], x.shape[1])
        for r, (_, t, k) in enumerate(rows):
            down[t, k] = x[r]
        out[(layer, kind)] = down
    return out


def sample(model, prompts: list[list[int]], n_new: int, seed: int, temperature: float = 1.0,
           eos: int = 1) -> list[Sampled]:
    """Each prompt sampled alone on ``model`` (slot 0: a prefill, then one decode step per token), with the
    engine's sampler (``serve/sampling.py``); the inputs of its quantized linears recorded."""
    from megatron_qarl.serve.request import SamplingParams
    from megatron_qarl.serve.sampling import sample as draw

    params = SamplingParams(temperature=temperature, max_new_tokens=n_new)
    out = []
    for i, prompt in enumerate(prompts):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        tokens, logps, routes, inputs = list(prompt), [], [], []
        with _server_recording(model) as calls:
            step = torch.tensor([prompt]), torch.arange(len(prompt))[None]
            while True:
                calls.clear()
                logits, r_BTLK = model.forward_routed(step[0], torch.tensor([0]), step[1])
                routes.append(r_BTLK[0].to(torch.int64))
                inputs.append(_per_position(calls, r_BTLK[0]))
                token, logp = draw(logits[0].float(), params, gen, original_logprob=False)
                tokens.append(token)
                logps.append(logp)
                if token == eos or len(logps) == n_new:
                    break
                step = torch.tensor([[token]]), torch.tensor([[len(tokens) - 1]])
        out.append(Sampled(tokens, len(prompt), logps, torch.cat(routes),
                           {key: torch.cat([d[key] for d in inputs]) for key in inputs[0]}))
    return out


# ----------------------------------------------------------------------------------------------- the learner
_NAME = re.compile(r"layers\.(\d+)\.(?:self_attention\.(linear_qkv|linear_proj)|mlp\.experts\.local_experts\.(\d+)"
                   r"\.(linear_fc1|linear_fc2))\.input_quantizer$")
_KIND = {"linear_qkv": "qkv", "linear_proj": "o", "linear_fc1": "gate_up", "linear_fc2": "down"}


def _input_quantizers(learner) -> dict:
    """The learner's W8A8 input quantizers: quantizer -> (layer, kind, expert or None)."""
    from megatron_qarl.qat.modules import _BOUND

    out = {}
    for name, mod in learner.module.named_modules():
        m = _NAME.search(name)
        if m and mod in _BOUND:
            layer, attn, expert, mlp = m.groups()
            out[mod] = (int(layer), _KIND[attn or mlp], None if expert is None else int(expert))
    return out


def _expert_rows(routes_BSLK: Tensor, layer: int, expert: int) -> tuple[Tensor, Tensor, Tensor]:
    """(b, s, slot) of the tokens routed to ``expert`` at ``layer``, in the order Megatron's dispatcher hands them
    to it: flat token index s x B + b ascending (its activations are [S, B, H])."""
    hit = routes_BSLK[:, :, layer] == expert  # [B, S, K]
    s, b, k = torch.nonzero(hit.permute(1, 0, 2), as_tuple=True)
    return b, s, k


@contextlib.contextmanager
def _learner_hooks(learner, routes_BSLK: Tensor, record: dict | None, feed: dict | None, scheme_fq: Callable):
    """Inside: each input quantizer records its input by (layer, kind) as [B, S, K_in] / down [B, S, topk, K_in]
    (``record``), and/or returns the quantized ``feed`` operand of the same tokens instead of its own (positions
    ``feed`` lacks keep the learner's)."""
    from megatron_qarl.qat.fake_quant import straight_through
    from megatron_qarl.qat.modules import _BOUND

    quantizers = _input_quantizers(learner)
    saved = {q: _BOUND[q] for q in quantizers}
    b_, s_ = routes_BSLK.shape[:2]

    def hook(q, layer, kind, expert):
        own = saved[q]

        def fn(x: Tensor) -> Tensor:
            if expert is None:
                view = lambda t: t.reshape(s_, b_, -1).transpose(0, 1)  # noqa: E731 - [S*B or S, B, K] -> [B, S, K]
                if record is not None:
                    record[(layer, kind)] = view(x.detach().float()).clone()
                if feed is None:
                    return own(x)
                fed = view(x.detach().float()).clone()
                have = feed[(layer, kind)]
                fed[have["mask"]] = have["x"][have["mask"]]
                return straight_through(x, scheme_fq(fed.transpose(0, 1).reshape(x.shape).to(x.dtype)))
            b, s, k = _expert_rows(routes_BSLK, layer, expert)
            if x.shape[0] != b.numel():
                raise AssertionError(f"layer {layer} expert {expert}: {x.shape[0]} rows, the routes give {b.numel()}")
            at = (b, s, k) if kind == "down" else (b, s)  # gate_up: the token's input, the same for its experts
            if record is not None:
                shape = (b_, s_, *([routes_BSLK.shape[-1]] if kind == "down" else []), x.shape[1])
                record.setdefault((layer, kind), torch.full(shape, float("nan")))[at] = x.detach().float()
            if feed is None:
                return own(x)
            have = feed[(layer, kind)]
            ours = x.detach().float()
            if kind == "gate_up":
                fed = torch.where(have["mask"][at][:, None], have["x"][at], ours)
                return straight_through(x, scheme_fq(fed.to(x.dtype)))
            # down: Megatron multiplies the routing weight p in before linear_fc2 (its activation_func_with_probs),
            # the server after its down GEMM; the codes are the same up to rounding (quantization per token is
            # scale-invariant), so the fed operand is the server's quantized one times p (p: the ratio of the
            # two rows' amax, exact to float32 rounding)
            h = have["x"][at]
            p = ours.abs().amax(-1, keepdim=True) / h.abs().amax(-1, keepdim=True).clamp(min=1e-30)
            fed = torch.where(have["mask"][at][:, None], scheme_fq(h) * p, scheme_fq(ours))
            return straight_through(x, fed.to(x.dtype))
        return fn

    for q, (layer, kind, expert) in quantizers.items():
        _BOUND[q] = hook(q, layer, kind, expert)
    try:
        yield
    finally:
        _BOUND.update(saved)


def _batch(seqs: list[Sampled], layers: int, topk: int) -> tuple[Tensor, Tensor]:
    """(tokens [B, S] right-padded with 0, routes [B, S, L, K]: the server's; experts 0..K-1 where it ran none)."""
    from megatron_qarl.algo.routing import routes_batch

    s = max(len(q.tokens) for q in seqs)
    tokens = torch.zeros(len(seqs), s, dtype=torch.int64)
    for i, q in enumerate(seqs):
        tokens[i, : len(q.tokens)] = torch.tensor(q.tokens)
    return tokens, routes_batch([q.routes for q in seqs], s, layers, topk)


def _server_feed(seqs: list[Sampled], shape: dict) -> dict:
    """The server's recorded inputs laid out as the learner's records: (layer, kind) -> {x, mask}."""
    feed = {}
    for key, full_shape in shape.items():
        x = torch.zeros(full_shape)
        mask = torch.zeros(full_shape[:-1], dtype=torch.bool)
        for i, q in enumerate(seqs):
            t = q.inputs[key]
            x[i, : t.shape[0]] = t
            mask[i, : t.shape[0]] = True
        feed[key] = {"x": x, "mask": mask}
    return feed


# ------------------------------------------------------------------------------------------------ the model
@dataclasses.dataclass
class Agreement:
    """Per response token (flattened over the sequences, in order): the learner's |logp - logp_sampler|
    (``diff``), the fed learner's (``residual``), and the activation-code flips at the token's position or before
    (``upstream``); and where the flips were: (layer, kind) -> count, the first flip of each sequence as
    (position, layer, kind), and the histogram of a flip's size in code steps."""

    diff: Tensor
    residual: Tensor
    upstream: Tensor
    where: dict
    primary: dict
    first: list
    steps: dict

    def problems(self, fp32_token: float) -> list[str]:
        """What breaks the model: a token the codes do not explain (the fed learner off by more than
        ``fp32_token``), a token with no flip upstream off by more than ``fp32_token``."""
        out = []
        bad = (self.residual > fp32_token).nonzero().flatten().tolist()
        if bad:
            out.append(f"{len(bad)} of {self.diff.numel()} tokens not explained by the activation codes (the learner "
                       f"fed the server's codes is off by up to {float(self.residual.max()):.2e} > {fp32_token:g}): "
                       f"tokens {bad[:10]}")
        clean = self.upstream == 0
        if clean.any() and float(self.diff[clean].max()) > fp32_token:
            n = int((self.diff[clean] > fp32_token).sum())
            out.append(f"{n} tokens with no flip upstream are off by up to {float(self.diff[clean].max()):.2e} "
                       f"> {fp32_token:g}")
        return out

    def summary(self) -> dict:
        d, flipped = self.diff.double(), self.upstream > 0
        return {"tokens": d.numel(), "max": float(d.max()), "median": float(d.median()),
                "over_1e-5": float((d > 1e-5).double().mean()), "flipped_share": float(flipped.double().mean()),
                "clean_max": float(d[~flipped].max()) if (~flipped).any() else 0.0,
                "residual_max": float(self.residual.max()), "flips": int(sum(self.where.values())),
                "primary": {f"{k[0]}.{k[1]}": v for k, v in sorted(self.primary.items()) if v},
                "steps": self.steps, "first": self.first[:8]}


def agreement(learner, seqs: list[Sampled], scheme: str, group: int) -> Agreement:
    """The flip model's figures for ``seqs`` (sampled by ``sample``) scored by ``learner`` (aligned, W8A8,
    routing_replay) on the server's routes."""
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.fake_quant import fake_quant_act

    cfg = QuantConfig(scheme=scheme, group_size=group)
    arch = learner.arch
    tokens, routes = _batch(seqs, arch.num_hidden_layers, arch.num_experts_per_tok)
    own: dict = {}
    with _learner_hooks(learner, routes, own, None, None):
        logp = learner.forward_logprobs(tokens, routes)
    feed = _server_feed(seqs, {k: v.shape for k, v in own.items()})
    with _learner_hooks(learner, routes, None, feed, lambda x: fake_quant_act(x, cfg)):
        logp_fed = learner.forward_logprobs(tokens, routes)
    b, s = tokens.shape
    flips_BS = torch.zeros(b, s)
    where, primary, steps = {}, {}, {}
    first_at: dict[int, tuple] = {}
    for (layer, kind), x in sorted(own.items(), key=lambda kv: (kv[0][0], KINDS.index(kv[0][1]))):
        mask = feed[(layer, kind)]["mask"]
        x_l, x_s = torch.nan_to_num(x[mask]), feed[(layer, kind)]["x"][mask]
        q_l, _ = codes(x_l, scheme, group)
        q_s, _ = codes(x_s, scheme, group)
        n = code_steps(q_l, q_s, scheme)  # [rows, K_in]
        per_row = (n > 0).sum(-1).float()
        count = torch.zeros(mask.shape)
        count[mask] = per_row
        # a primary flip: a code differs in a row whose inputs (each over its amax: the codes' argument, and Megatron
        # weights the experts' down input by the routing weight first) agree to float32 rounding
        norm = lambda t: t / t.abs().amax(-1, keepdim=True).clamp(min=1e-30)  # noqa: E731
        primary_row = (norm(x_l) - norm(x_s)).abs().amax(-1) <= PRIMARY_REL
        prim = torch.zeros(mask.shape, dtype=torch.bool)
        prim[mask] = primary_row & (per_row > 0)
        if count.dim() == 3:  # down: [B, S, topk]
            count, prim = count.sum(-1), prim.any(-1)
        flips_BS += count
        where[(layer, kind)] = int(per_row.sum())
        primary[(layer, kind)] = int(per_row[primary_row].sum())
        for v, c in zip(*torch.unique(n[primary_row][n[primary_row] > 0], return_counts=True), strict=True):
            steps[int(v)] = steps.get(int(v), 0) + int(c)
        for i in range(b):
            hit = prim[i].nonzero().flatten()
            if hit.numel() and (i not in first_at or int(hit[0]) < first_at[i][0]):
                first_at[i] = (int(hit[0]), layer, kind)
    first = [first_at.get(i) for i in range(b)]
    upstream_BS = flips_BS.cumsum(1)
    diffs, residuals, ups = [], [], []
    for i, q in enumerate(seqs):
        pos = torch.arange(q.prompt_len - 1, len(q.tokens) - 1)  # logp[:, t] predicts token t + 1
        sampler = torch.tensor(q.logp)
        diffs.append((logp[i, pos] - sampler).abs())
        residuals.append((logp_fed[i, pos] - sampler).abs())
        ups.append(upstream_BS[i, pos])
    return Agreement(torch.cat(diffs), torch.cat(residuals), torch.cat(ups), where, primary, first,
                     dict(sorted(steps.items())))


# --------------------------------------------------------------------------------------- a whole measurement
def prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` training prompts of the math task, tokenized as the trainer does (the tiny model's tokenizer)."""
    import random

    from tokenizers import Tokenizer

    from megatron_qarl.data.math_task import MathTaskConfig, sample_problem

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    rng = random.Random(seed)
    return [tok.encode(sample_problem(rng, MathTaskConfig()).prompt, add_special_tokens=False).ids for _ in range(n)]


def plant_wrong_scale(model, layer: int = 0, expert: int = 0, factor: float = 1.05) -> None:
    """The planted defect: one expert's gate_up weight scales on the server multiplied by ``factor`` (what a sync
    that dropped a scale's update, or applied another block's, would leave)."""
    lin = model.layers[layer].gate_up[expert]
    names = [n for n in lin.names if n.endswith(("weight_scale_inv", "weight_scale"))]
    model.load_tensors({n: model.store[n] * factor for n in names})
    model.finalize_weights()


def measure(model_dir: str, served_dir: str, scheme: str, seeds: list[int], n_prompts: int = 4, n_new: int = 24,
            defect: dict | None = None) -> list[dict]:
    """Per seed: the learner (one rank, float32, aligned, R3) on ``model_dir`` and the engine (float32) on
    ``served_dir`` (its export), ``n_prompts`` prompts sampled once each; the Agreement's summary and problems.
    ``defect``: ``plant_wrong_scale``'s arguments, applied to the engine first. Call in a rank (``run_ranks``)."""
    from combination_runs import FP32_TOKEN

    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Learner
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import init_parallel
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.serve.model import Qwen3MoeEngineModel

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(seed=7)
    quant = QuantConfig(scheme=scheme)
    # Megatron's SequentialMLP: the hooks above feed each expert's own input quantizer (the grouped experts, bit for bit
    # the same learner, quantize a layer's routed tokens in one call: tests/test_grouped_experts.py)
    learner = Learner(arch, ParallelConfig(), OptimConfig(), quant=quant, routing_replay=True, experts="sequential")
    learner.load_hf(model_dir)
    model = Qwen3MoeEngineModel.from_model_dir(served_dir, torch.float32, 1, None)
    if defect is not None:
        plant_wrong_scale(model, **defect)
    out = []
    for seed in seeds:
        seqs = sample(model, prompts(n_prompts, seed), n_new, seed)
        a = agreement(learner, seqs, scheme, quant.group_size)
        out.append({"seed": seed, **a.summary(), "problems": a.problems(FP32_TOKEN),
                    "diff": a.diff.tolist(), "upstream": a.upstream.tolist()})
    return out


def perturbed_checkpoint(out: Path, seed: int, scale: float = 1e-3) -> str:
    """The tiny checkpoint with every weight moved by N(0, (scale x its std)^2) (another weight version, as a
    training step makes: other activations land near other rounding boundaries); seed 0: the checkpoint itself."""
    import shutil

    from safetensors.torch import load_file, save_file

    if seed == 0:
        return str(TINY)
    out.mkdir(parents=True, exist_ok=True)
    for f in TINY.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(TINY / "model.safetensors"))
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel() > 1:
            tensors[name] = t + torch.randn(t.shape, generator=gen, dtype=t.dtype) * (scale * float(t.float().std()))
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


# MKL picks its kernels by CPU vendor: on a CPU that is not Intel's it takes its generic path and ignores
# MKL_ENABLE_INSTRUCTIONS (the same bits under SSE4_2, AVX2 and AVX512 on an AMD EPYC). With its vendor check
# answered "Intel" (two functions of libtorch_cpu.so's MKL, interposed by LD_PRELOAD) it dispatches as on an Intel
# CPU of the same instruction sets, knob included: how an AMD machine runs the sgemm kernels of the AMX /
# AVX512-FP16 Xeon (issue 47: run06 there and so here, fresh max 0.0698 under AVX512 and 0.0031 under AVX2)
INTEL_DISPATCH_C = "int mkl_serv_intel_cpu_true(void) { return 1; }\nint mkl_serv_intel_cpu(void) { return 1; }\n"


def intel_dispatch(tmp: Path) -> dict[str, str] | None:
    """The environment that makes MKL dispatch as on an Intel CPU here (``INTEL_DISPATCH_C`` built with the C
    compiler); None on an Intel CPU (it already does) or without a compiler."""
    import shutil
    import subprocess

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cc = shutil.which("cc") or shutil.which("gcc")
    if "GenuineIntel" in cpuinfo or cc is None:
        return None
    (tmp / "intel_dispatch.c").write_text(INTEL_DISPATCH_C)
    lib = tmp / "libintel_dispatch.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(tmp / "intel_dispatch.c")], check=True)
    return {"LD_PRELOAD": str(lib)}


def _main() -> None:
    """Measure the flip model's figures over weight versions x sampling seeds, in this process's environment (set
    the ISA knobs before it starts: MKL reads them when it loads); one JSON line per (scheme, weights, seed)."""
    import argparse
    import json
    import os
    import sys
    import tempfile

    from megatron_qarl.moe.parallelize import run_ranks
    from megatron_qarl.qat.export import quantize_checkpoint

    ap = argparse.ArgumentParser(description=_main.__doc__)
    ap.add_argument("--scheme", default="w8a8_fp8", help="w8a8_fp8, w8a8_int8 or both, comma-separated")
    ap.add_argument("--weights", default="0", help="weight versions: 0 = the checkpoint, n > 0 = perturbed (seed n)")
    ap.add_argument("--seeds", default="1", help="sampling seeds, e.g. 1-10 or 1,2,3")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--defect", type=json.loads, default=None,
                    help='plant_wrong_scale on the engine, e.g. {"layer": 0, "expert": 0, "factor": 1.05}')
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    def ints(spec: str) -> list[int]:
        return [i for part in spec.split(",") for i in (range(int(part.split("-")[0]), int(part.split("-")[1]) + 1)
                                                         if "-" in part else [int(part)])]

    env = {k: os.environ.get(k) for k in ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA",
                                          "LD_PRELOAD")}
    with tempfile.TemporaryDirectory() as tmp, open(args.out, "a") as out:
        for scheme in args.scheme.split(","):
            for w in ints(args.weights):
                model_dir = perturbed_checkpoint(Path(tmp) / f"w{w}", w)
                served = quantize_checkpoint(model_dir, scheme, Path(tmp) / f"w{w}_{scheme}")
                rows = run_ranks(1, measure, model_dir, str(served), scheme, ints(args.seeds), args.prompts,
                                 args.new, args.defect)[0]
                for r in rows:
                    out.write(json.dumps({"scheme": scheme, "weights": w, "env": env, "defect": args.defect, **r})
                              + "\n")
                    print(scheme, w, r["seed"], f"max {r['max']:.2e} median {r['median']:.2e} residual "
                          f"{r['residual_max']:.1e}", r["first"][:1], r["problems"], file=sys.stderr)


if __name__ == "__main__":
    _main()
