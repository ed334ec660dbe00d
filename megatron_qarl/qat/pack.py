"""INT4 packing in compressed-tensors' "pack-quantized" int32 layout (what SGLang's WNA16 loader reads).

Codes q in [-8, 7] are stored unsigned, u = q + 8 in [0, 15]; eight of them per int32 word along the
packed dim, low nibble first: nibble i of word j holds u[8j + i] at bits 4i..4i+3. A last partial word
is padded with u = 0. The arithmetic runs in int64 and wraps to int32, so it does not depend on the
host's byte order.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.cache
def _shifts(device: torch.device) -> Tensor:
    """The bit offset of nibble i, 4i (int64 [8]), made once per device: a copy to the device per packed tensor
    would be a host-to-device transfer per tensor on the weight sync's path."""
    return torch.arange(0, 32, 4, dtype=torch.int64, device=device)


def pack_int4(codes: Tensor, packed_dim: int = 1, check: bool = False) -> Tensor:
    """int8 codes [R, C] in [-8, 7] -> int32 [R, ceil(C/8)] (packed_dim 1) or [ceil(R/8), C] (dim 0).

    The codes' range is not read here (that is a device-to-host read per tensor, on the weight sync's path): the
    project's quantizer clamps every code it makes to [-8, 7]. ``check``: read it anyway (one host read), for codes
    from elsewhere; a code outside [-8, 7] would spill into its neighbour's nibble."""
    if codes.dtype != torch.int8 or codes.ndim != 2:
        raise ValueError(f"pack_int4 expects 2-D int8 codes, got {codes.dtype} {list(codes.shape)}")
    if check and bool(((codes < -8) | (codes > 7)).any()):
        raise ValueError("pack_int4: codes outside [-8, 7]")
    if packed_dim == 0:
        return pack_int4(codes.t(), packed_dim=1).t().contiguous()
    rows, cols = codes.shape
    u = codes.to(torch.int64) + 8  # [R, C] in 0..15
    pad = -cols % 8
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))  # padding nibbles are u = 0
    words = (u.reshape(rows, -1, 8) << _shifts(u.device)).sum(dim=-1)  # [R, C/8] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # wrap to signed int32
    return words.to(torch.int32)


def unpack_int4(packed: Tensor, size: int, packed_dim: int = 1) -> Tensor:
    """Inverse of ``pack_int4``: int32 -> int8 codes in [-8, 7]; ``size``: original length of packed_dim."""
    if packed.dtype != torch.int32 or packed.ndim != 2:
        raise ValueError(f"unpack_int4 expects 2-D int32, got {packed.dtype} {list(packed.shape)}")
    if packed_dim == 0:
        return unpack_int4(packed.t(), size, packed_dim=1).t().contiguous()
    rows = packed.shape[0]
    words = packed.to(torch.int64) & 0xFFFFFFFF  # [R, W] unsigned
    u = (words[..., None] >> _shifts(packed.device)) & 0xF  # [R, W, 8]
    return (u.reshape(rows, -1)[:, :size] - 8).to(torch.int8)
