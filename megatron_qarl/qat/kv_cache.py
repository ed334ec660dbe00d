"""The rollout's FP8 KV cache, and the learner's attention on the very keys and values that cache holds: the one
owner of the rounding (``rollout.kv_cache_dtype``; docs/quantization.md "The KV cache").

SGLang 0.5.23 stores a token's key and value in the cache as (sglang/srt/mem_cache/memory_pool.py,
``MHATokenToKVPool.set_kv_buffer``; the attention backends hand it the layer's ``k_scale`` / ``v_scale``)::

    cache_k.div_(k_scale)            # in the server's compute dtype: float32(k) / float32(k_scale), rounded to it
    cache_k = cache_k.to(fp8)        # torch's cast, c10's fp8e4m3fn / fp8e5m2 _from_fp32_value: round to nearest
                                     # even; e4m3fn saturates a finite overflow to +-448 (NaN stays NaN), e5m2
                                     # rounds past 57344 to +-inf
    k_buffer[loc] = cache_k.view(uint8)

and its attention reads ``fp8 -> compute dtype`` times the scale (the kernels fold k_scale into the softmax scale
and v_scale into the output, the same numbers where the products are exact: scale 1.0, powers of two). So

    store(x)  = fp8(act(float32(x) / s))                             ``kv_store``
    load(c)   = act(float32(c) * s)                                  ``kv_load``
    x_kv      = load(store(x))                                       ``kv_round_trip``

with ``act`` the servers' compute dtype (rollout.dtype) and ``s`` the layer's scale (1.0 unless the checkpoint
carries ``self_attn.attn.k_scale`` / ``v_scale``, which SGLang reads only where the checkpoint's quantization
method gives attention a KV-cache method: ``KVCacheSpec.scales_of``). The embedded engine (serve/model.py) keeps
``store(x)`` as one byte per element and attends over ``load``; the learner's attention (``KVFakeQuant``) computes
on ``x_kv`` in its own dtype with a straight-through backward: every key and value after the k-norm and rotary
embedding, on any core attention (Megatron's unfused DotProductAttention, Transformer Engine's, or a replacement),
at any TP (elementwise: heads split or not) and with sequence parallel (the core attention sees the whole
sequence). Under ``numerics: exact`` the same formula runs in C on both sides (numerics/exact.c ``qx_kv_round``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megatron_qarl.qat.fake_quant import straight_through

if TYPE_CHECKING:
    from megatron_qarl.config import QarlConfig

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "fp8_e5m2")
FP8: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# the scale tensors' names in a checkpoint, as SGLang's RadixAttention parameters (``BaseKVCacheMethod
# .create_weights``) under Qwen3-MoE's ``load_weights``, which takes a checkpoint name as the parameter's name
SCALE_NAMES = ("model.layers.{i}.self_attn.attn.k_scale", "model.layers.{i}.self_attn.attn.v_scale")


def kv_store(x: Tensor, scale: float, fp8: torch.dtype, act: torch.dtype) -> Tensor:
    """SGLang's write: fp8(act(float32(x) / scale)), the codes as ``fp8`` (``x`` in any float dtype: it is taken in
    ``act`` first, the server's K / V)."""
    s = torch.tensor(scale, dtype=torch.float32, device=x.device)  # a tensor on x's device: a true division
    return (x.to(act).float() / s).to(act).to(fp8)


def kv_load(codes: Tensor, scale: float, act: torch.dtype) -> Tensor:
    """The attention's read of stored codes: act(float32(codes) * scale)."""
    s = torch.tensor(scale, dtype=torch.float32, device=codes.device)
    return (codes.float() * s).to(act)


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
    def build(cls, dtype: str, act: torch.dtype, num_layers: int, model_dir: str | Path | None = None,
              source: str = "unit") -> KVCacheSpec | None:
        """The spec of a run (None for ``auto``: the cache in the compute dtype, nothing rounded). ``source``
        ``unit``: every scale 1.0 (SGLang's default when the checkpoint holds none); ``checkpoint``: the scales of
        ``model_dir`` (``scales_of``)."""
        if dtype == "auto":
            return None
        if source == "unit":
            return cls(dtype, act, ((1.0, 1.0),) * num_layers)
        if source == "checkpoint":
            return cls(dtype, act, scales_of(model_dir, num_layers))
        raise ValueError(f"rollout.kv_cache_scales: {source!r} is not one of unit, checkpoint")


def scales_of(model_dir: str | Path | None, num_layers: int) -> tuple[tuple[float, float], ...]:
    """Each layer's (k_scale, v_scale) from a checkpoint's safetensors (``SCALE_NAMES``, float32 scalars); a
    ValueError naming the file and the first tensor missing."""
    from megatron_qarl.qat.export import iter_safetensors

    if model_dir is None:
        raise ValueError("rollout.kv_cache_scales: checkpoint needs a model directory")
    wanted = {SCALE_NAMES[w].format(i=i) for i in range(num_layers) for w in (0, 1)}
    found = {name: float(t.float().reshape(-1)[0]) for name, t in iter_safetensors(model_dir) if name in wanted}
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(f"rollout.kv_cache_scales: checkpoint, but {model_dir} has no tensor {missing[0]} "
                         f"({len(missing)} of the {len(wanted)} KV-cache scales missing)")
    return tuple((found[SCALE_NAMES[0].format(i=i)], found[SCALE_NAMES[1].format(i=i)]) for i in range(num_layers))


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
        self._handles = []
        layers = list(model.decoder.layers)
        if len(layers) != len(spec.scales):
            raise ValueError(f"the KV cache spec has {len(spec.scales)} layers' scales, the model {len(layers)}")
        for i, layer in enumerate(layers):
            self._handles.append(layer.self_attention.core_attention.register_forward_pre_hook(
                self._hook(i), with_kwargs=True))

    def _hook(self, layer: int) -> Callable:
        def hook(module, args, kwargs):
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


def run_spec(cfg: QarlConfig, layers: int) -> KVCacheSpec | None:
    """A run's spec: rollout.kv_cache_dtype in rollout.dtype, the scales rollout.kv_cache_scales names (checkpoint:
    model.path's, which the servers' export carries; ``qat.export.quantize_checkpoint``)."""
    from megatron_qarl.wire import parse_dtype

    r = cfg.rollout
    return KVCacheSpec.build(r.kv_cache_dtype, parse_dtype(r.dtype), layers, cfg.model.path, r.kv_cache_scales)
