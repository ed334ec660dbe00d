"""SGLang's weight checksum (``POST /weights_checker {"action": "checksum"}``), as SGLang 0.5.23 defines it.

Read from sglang/srt/utils/weight_checker.py and sglang/srt/managers/mm_utils.py (``tensor_hash``):

    tensor checksum   = the first 8 bytes of sha256(raw bytes of the tensor, C order), big-endian, as 16 hex digits
    per-GPU checksum  = sha256 over the names in sorted order of (name, then its tensor checksum), hex
    per-engine        = sha256 over the per-GPU checksums in rank order, hex

A block-FP8 weight (an ``float8_e4m3fn`` ``...weight`` with a ``...weight_scale_inv`` beside it) is hashed
dequantized to bf16 (SGLang's ``Fp8BlockComparable.dequantize``: q * scale repeated over its
[block, block] tile, block = K / scale columns) and its scale is not hashed on its own, so two (weight,
scale) pairs that mean the same bf16 weight have one checksum.

The learner computes these over the tensors it sends and the embedded server over what it holds, under
the same (checkpoint-format) names. A real SGLang server hashes its own parameters instead: fused
``w13`` experts, Marlin-repacked int4, TP shards, under its module names, which the learner cannot
reproduce without SGLang's loader and GPU kernels (docs/rollout.md, "Against a real SGLang server").
"""

from __future__ import annotations

import hashlib

import torch


def tensor_checksum(t: torch.Tensor) -> str:
    """16 hex digits: sha256 of the raw bytes, first 8 bytes read big-endian (SGLang's ``tensor_hash``)."""
    t = t.detach().cpu().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    return f"{int.from_bytes(hashlib.sha256(data).digest()[:8], 'big'):016x}"


def overall_checksum(checksums: dict[str, str]) -> str:
    """One GPU's checksum: sha256 over sorted names of name + tensor checksum."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def engine_checksum(per_gpu: list[str]) -> str:
    """A server's checksum: sha256 over its ranks' per-GPU checksums, in rank order."""
    h = hashlib.sha256()
    for c in per_gpu:
        h.update(c.encode())
    return h.hexdigest()


def _scale_name(name: str) -> str:
    """SGLang pairs a module's ``...weight`` parameter with ``...weight_scale_inv`` (in the last component)."""
    head, dot, last = name.rpartition(".")
    return head + dot + last.replace("weight", "weight_scale_inv")


def fp8_block_dequant(w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 of a block-FP8 weight: w_q * scale[n // b, k // b], b = K / scale's columns."""
    n, k = w_q.shape[-2:]
    if k % scale.shape[-1]:
        raise ValueError(f"cannot infer the FP8 block size from weight {list(w_q.shape)} and scale {list(scale.shape)}")
    block = k // scale.shape[-1]
    s = scale.to(w_q.device).float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :n, :k]
    return (w_q.float() * s).to(torch.bfloat16)


class ChecksumAccumulator:
    """Tensor checksums of a stream of named tensors (a sync sends them bucket by bucket): block-FP8
    weights are held until their scale arrives (or the scale until its weight), then hashed dequantized."""

    def __init__(self) -> None:
        self.checksums: dict[str, str] = {}
        self._weights: dict[str, torch.Tensor] = {}  # fp8 weight name -> weight, waiting for its scale
        self._scales: dict[str, torch.Tensor] = {}  # scale name -> scale, waiting for its weight

    def add(self, name: str, t: torch.Tensor) -> None:
        scale = _scale_name(name)
        if t.dtype == torch.float8_e4m3fn and scale != name:
            if scale in self._scales:
                self.checksums[name] = tensor_checksum(fp8_block_dequant(t, self._scales.pop(scale)))
            else:
                self._weights[name] = t
            return
        if name.endswith("weight_scale_inv"):
            weight = next((w for w in self._weights if _scale_name(w) == name), None)
            if weight is not None:
                self.checksums[weight] = tensor_checksum(fp8_block_dequant(self._weights.pop(weight), t))
            else:
                self._scales[name] = t
            return
        self.checksums[name] = tensor_checksum(t)

    def result(self) -> dict[str, str]:
        """The checksums; an FP8 weight or scale that never met its partner is hashed raw."""
        for name, t in {**self._weights, **self._scales}.items():
            self.checksums[name] = tensor_checksum(t)
        self._weights.clear()
        self._scales.clear()
        return dict(self.checksums)


def weight_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> tensor checksum of a set of named tensors, block-FP8 weights dequantized (scales consumed)."""
    acc = ChecksumAccumulator()
    for name, t in tensors.items():
        acc.add(name, t)
    return acc.result()
