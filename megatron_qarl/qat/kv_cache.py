"""The rollout's FP8 KV cache, and the learner's attention on the very keys and values that cache holds: the one
owner of the rounding (``rollout.kv_cache_dtype``; docs/quantization.md "The KV cache").

SGLang 0.5.23 stores a token's key and value in the cache as (sglang/srt/mem_cache/memory_pool.py,
``MHATokenToKVPool.set_kv_buffer``; the attention backends hand it the layer's ``k_scale`` / ``v_scale``)::

    cache_k.div_(k_scale)            # in the server's compute dtype: float32(k) / float32(k_scale), rounded to it
    cache_k = cache_k.to(fp8)        # torch's cast, c10's fp8e4m3fn / fp8e5m2 _from_fp32_value: round to nearest
                                     # even; e4m3fn saturates a finite overflow to +-448 (NaN stays NaN), e5m2
                                     # rounds 61440 and beyond to +-inf
    k_buffer[loc] = cache_k.view(uint8)

and its attention reads ``fp8 -> compute dtype`` times the scale (the kernels fold k_scale into the softmax scale
and v_scale into the output, the same numbers where the products are exact: scale 1.0, powers of two). So

    store(x)  = fp8(act(float32(x) / s))                             ``kv_store``
    load(c)   = act(float32(c) * s)                                  ``kv_load``
    x_kv      = load(store(x))                                       ``kv_round_trip``

with ``act`` the servers' compute dtype (rollout.dtype) and ``s`` the layer's scale. For Qwen3-MoE, SGLang 0.5.23's
scales are 1.0 whatever the checkpoint holds: its ``Qwen3MoeAttention`` builds its ``RadixAttention`` without the
quant config (sglang/srt/models/qwen3_moe.py), so attention gets no KV-cache method (layers/quantization/kv_cache.py
``BaseKVCacheMethod``, which would load ``self_attn.attn.k_scale`` / ``v_scale``), ``layer.k_scale`` stays None and
neither the write divides nor the read multiplies; checkpoint scale tensors are skipped by its ``load_weights`` (no
such parameter), and ``--quantization-param-path`` fails at load (``Qwen3MoeForCausalLM`` has no
``load_kv_cache_scales``: model_runner_components/load_model_utils.py). tests/test_sglang_contract.py builds SGLang's
model to show it. So there is no scale to calibrate or write where SGLang would read it; the functions here take a
scale all the same (exact.c too), and the runs' specs hold 1.0. The embedded engine (serve/model.py) keeps
``store(x)`` as one byte per element and attends over ``load``; the learner's attention (``KVFakeQuant``) computes
on ``x_kv`` in its own dtype with a straight-through backward: every key and value after the k-norm and rotary
embedding, on any core attention (Megatron's unfused DotProductAttention, Transformer Engine's, or a replacement),
at any TP (elementwise: heads split or not) and with sequence parallel (the core attention sees the whole
sequence). Under ``numerics: exact`` the same formula runs in C on both sides (numerics/exact.c ``qx_kv_round``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megatron_qarl.qat.fake_quant import straight_through

if TYPE_CHECKING:
    from megatron_qarl.config import QarlConfig

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "fp8_e5m2")
FP8: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# the names KV-cache scales would have in a checkpoint: SGLang's RadixAttention parameters (``BaseKVCacheMethod
# .create_weights``); Qwen3-MoE's attention has none, and its load_weights skips such tensors (module docstring)
SCALE_NAMES = ("model.layers.{i}.self_attn.attn.k_scale", "model.layers.{i}.self_attn.attn.v_scale")


E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def _scale(scale: float, device: torch.device) -> Tensor:
    """The scale as a float32 tensor on ``device``, made once per (scale, device): a division by a tensor on the
    operand's device is a true division (CUDA's division by a CPU scalar multiplies by its reciprocal), and a tensor
    made from a Python number for each call would be a copy to the device, waited for, in every layer."""
    key = (float(scale), str(device))
    held = _SCALES.get(key)
    if held is None:
        held = _SCALES[key] = torch.tensor(scale, dtype=torch.float32, device=device)
    return held


_SCALES: dict[tuple[float, str], Tensor] = {}


def kv_store(x: Tensor, scale: float, fp8: torch.dtype, act: torch.dtype) -> Tensor:
    """SGLang's write: fp8(act(float32(x) / scale)), the codes as ``fp8`` (``x`` in any float dtype: it is taken in
    ``act`` first, the server's K / V). e4m3 saturates at +-448 (torch 2.13 / 2.14's cast, SGLang's servers'): clamped
    first, nan kept, so that a learner's older torch, whose cast gave nan from about 464, rounds the same. Scale 1 (the
    only one SGLang 0.5.23's Qwen3-MoE has, module docstring): x / 1 and act(float32(act(x))) are act(x) exactly, so
    the division is left out (the same bits, two kernels and no scale tensor fewer)."""
    y = x.to(act) if scale == 1.0 else (x.to(act).float() / _scale(scale, x.device)).to(act)
    if fp8 == torch.float8_e4m3fn:
        y = y.clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(fp8)


def kv_load(codes: Tensor, scale: float, act: torch.dtype) -> Tensor:
    """The attention's read of stored codes: act(float32(codes) * scale) (scale 1: act(codes), the same bits: an FP8
    value is exact in float32, bfloat16 and float16)."""
    if scale == 1.0:
        return codes.to(act)
    return (codes.float() * _scale(scale, codes.device)).to(act)


def kv_load_table(fp8: torch.dtype, scale: float, act: torch.dtype) -> Tensor:
    """``kv_load`` of each of the 256 codes, indexed by the code's byte: ``table[codes.view(uint8).long()]`` is
    ``kv_load(codes, scale, act)`` bit for bit (the same function of each byte), and on CPU 25-40x faster than torch's
    float8_e4m3fn conversion (measured 0.2-0.3 ms against 7.8 ms for 266k elements, 2 threads)."""
    return kv_load(torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8), scale, act)


def kv_round_trip(x: Tensor, scale: float, fp8: torch.dtype, act: torch.dtype) -> Tensor:
    """load(store(x)) in ``act``: the key or value the server's attention computes with."""
    return kv_load(kv_store(x, scale, fp8, act), scale, act)


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The servers' KV cache as the learner reproduces it: ``dtype`` (fp8_e4m3 | fp8_e5m2), ``act`` (their compute
    dtype, rollout.dtype) and each layer's (k_scale, v_scale)."""

    dtype: str
    act: torch.dtype
    scales: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if self.dtype not in FP8:
            raise ValueError(f"rollout.kv_cache_dtype: {self.dtype!r} is not one of {', '.join(FP8)}")
        bad = [(i, s) for i, pair in enumerate(self.scales) for s in pair if not (s > 0 and s < float("inf"))]
        if bad:
            raise ValueError(f"KV cache scales must be finite and > 0; layer {bad[0][0]} has {bad[0][1]}")

    @property
    def fp8(self) -> torch.dtype:
        return FP8[self.dtype]

    def round_trip(self, x: Tensor, layer: int, which: int) -> Tensor:
        """``x`` (layer ``layer``'s keys, which 0, or values, 1) as the server's attention reads them, in ``x``'s
        dtype, with a straight-through gradient."""
        with torch.no_grad():
            y = kv_round_trip(x.detach(), self.scales[layer][which], self.fp8, self.act).to(x.dtype)
        return straight_through(x, y) if x.requires_grad else y

    @classmethod
    def build(cls, dtype: str, act: torch.dtype, num_layers: int) -> KVCacheSpec | None:
        """The spec of a run's servers (None for ``auto``: the cache in the compute dtype, nothing rounded), every
        scale 1.0 (SGLang 0.5.23's for Qwen3-MoE: the module docstring)."""
        if dtype == "auto":
            return None
        return cls(dtype, act, ((1.0, 1.0),) * num_layers)


def bytes_per_element(dtype: str, act_bytes: int) -> int:
    """What one key or value element takes in the servers' cache: 1 byte in FP8, else the compute dtype's."""
    return 1 if dtype in FP8 else act_bytes


class KVFakeQuant:
    """The learner's keys and values rounded as the servers' cache rounds them: a forward pre-hook on every decoder
    layer's ``self_attention.core_attention``, whose call Megatron's ``Attention.forward`` makes with (query, key,
    value, attention_mask, ...) after the k-norm and the rotary embedding (megatron/core/transformer/attention.py;
    also inside selective recompute's checkpoint), whatever module the core attention is."""

    def __init__(self, model: torch.nn.Module, spec: KVCacheSpec):
        self.spec = spec
        self.enabled = True  # False: the keys and values pass as computed (the learner's unaware forward)
        self._handles = []
        layers = list(model.decoder.layers)
        if len(layers) != len(spec.scales):
            raise ValueError(f"the KV cache spec has {len(spec.scales)} layers' scales, the model {len(layers)}")
        for i, layer in enumerate(layers):
            self._handles.append(layer.self_attention.core_attention.register_forward_pre_hook(
                self._hook(i), with_kwargs=True))

    def _hook(self, layer: int) -> Callable:
        def hook(module, args, kwargs):
            if not self.enabled:
                return None
            if len(args) < 3:  # Megatron passes query, key, value positionally
                raise TypeError(f"{type(module).__name__} called with {len(args)} positional arguments; the KV "
                                "cache's fake quant expects (query, key, value, ...)")
            key, value = self.spec.round_trip(args[1], layer, 0), self.spec.round_trip(args[2], layer, 1)
            return (args[0], key, value, *args[3:]), kwargs
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@contextlib.contextmanager
def kv_unaware(hook: KVFakeQuant | None, exact) -> Iterator[None]:
    """A learner's forwards, for the duration, as if built without the servers' FP8 cache: its core attention hook
    off and its exact forward's (moe/exact.py ``ExactForward``, or None) ``kv`` None."""
    kept = exact.kv if exact is not None else None
    if hook is not None:
        hook.enabled = False
    if exact is not None:
        exact.kv = None
    try:
        yield
    finally:
        if hook is not None:
            hook.enabled = True
        if exact is not None:
            exact.kv = kept


def run_spec(cfg: QarlConfig, layers: int) -> KVCacheSpec | None:
    """A run's spec: its servers' rollout.kv_cache_dtype in rollout.dtype."""
    from megatron_qarl.wire import parse_dtype

    return KVCacheSpec.build(cfg.rollout.kv_cache_dtype, parse_dtype(cfg.rollout.dtype), layers)
