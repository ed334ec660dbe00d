"""ModelOpt (nvidia-modelopt) as an input format: map an ``mtq`` config to a QaRL QuantConfig, and run
ModelOpt's stock fake quant for comparison.

A ModelOpt config names a scheme; the numerics stay the one quantizer's (``quantizer.py``): ModelOpt's
stock INT4 fake quant is round(w * 7/amax) / (7/amax) in fp32 with codes in [-7, 7] and an fp32 scale,
which is not what SGLang's Marlin kernel computes (bf16 scale, codes in [-8, 7]); the difference is
measured by scripts/compare_modelopt_int4.py (docs/quantization.md).

Mapping (weight quantizer -> scheme; the input quantizer must agree or be off):
    num_bits 4, block_sizes {-1: G}                       -> w4a16, group_size G (input quantizer off)
    num_bits (4, 3), block_sizes {-1: B, -2: B}           -> w8a8_fp8, block B (acts: fp8 or off)
    num_bits 8, axis 0 (per output channel)               -> w8a8_int8 (acts: int8 or off)
SGLang quantizes W8A8 activations per token (group) dynamically whatever a ModelOpt config says, so an
enabled input quantizer only has to be of the same type. Everything else (per-tensor FP8, NVFP4/MX,
AWQ/SmoothQuant calibration, per-module overrides) raises ValueError. ModelOpt's disabled module
patterns are added to the scheme's default ignore list.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from megatron_qarl.qat.config import DEFAULT_IGNORE, QuantConfig

_WEIGHT, _INPUT = "*weight_quantizer", "*input_quantizer"
_DISABLED = {"enable": False}


def _entries(mtq_cfg: Mapping[str, Any]) -> list[tuple[str, Any, str | None]]:
    """(quantizer pattern, attributes, parent class or None) in application order, for the list form
    (ModelOpt 0.4x) and the older dict form ({pattern: attrs}, class-keyed dicts of patterns)."""
    quant_cfg = mtq_cfg.get("quant_cfg")
    if quant_cfg is None:
        raise ValueError("ModelOpt config has no 'quant_cfg'")
    out: list[tuple[str, Any, str | None]] = []
    if isinstance(quant_cfg, Mapping):
        if "default" in quant_cfg:  # ModelOpt applies "default" to every quantizer first
            out.append(("*", quant_cfg["default"], None))
        for key, value in quant_cfg.items():
            if key.startswith("nn.") and isinstance(value, Mapping):  # {"nn.BatchNorm1d": {"*": {...}}}
                out.extend((pattern, attrs, key) for pattern, attrs in value.items())
            elif key != "default":
                out.append((key, value, None))
        return out
    for entry in quant_cfg:
        cfg = entry.get("cfg")
        attrs = cfg if isinstance(cfg, list) else dict(cfg or {})
        if isinstance(attrs, dict) and "enable" in entry:
            attrs["enable"] = entry["enable"]
        out.append((entry["quantizer_name"], attrs, entry.get("parent_class")))
    return out


def _glob_to_module_regex(pattern: str) -> str:
    """A ModelOpt quantizer-name wildcard (``*mlp.gate.*``, ``*lm_head*``) as a QaRL module-name regex."""

    def glob(s: str) -> str:
        return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in s)

    if pattern.endswith(".*"):
        return "re:" + glob(pattern[:-2]) + r"(\..*)?$"
    if pattern.endswith("*"):
        return "re:" + glob(pattern[:-1]) + ".*"
    raise ValueError(f"ModelOpt pattern {pattern!r}: only patterns ending in '*' or '.*' are supported")


def _bits(attrs: Mapping[str, Any]) -> int | tuple[int, ...]:
    bits = attrs.get("num_bits", 8)
    return tuple(bits) if isinstance(bits, (list, tuple)) else int(bits)


def _algorithm_name(algorithm: Any) -> str | None:
    if isinstance(algorithm, Mapping):
        return algorithm.get("method")
    return algorithm


def quant_config_from_modelopt(mtq_cfg: Mapping[str, Any]) -> QuantConfig:
    """Map a ModelOpt ``mtq`` config dict (e.g. ``mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG``) to a QuantConfig."""
    algorithm = _algorithm_name(mtq_cfg.get("algorithm", "max"))
    if algorithm not in (None, "max"):
        raise ValueError(
            f"ModelOpt algorithm {algorithm!r} is not supported: the one quantizer is round-to-nearest "
            "with max calibration (use algorithm 'max')"
        )
    weight: Any = _DISABLED
    act: Any = _DISABLED
    ignore: list[str] = []
    for pattern, attrs, parent_class in _entries(mtq_cfg):
        if parent_class is not None:
            if isinstance(attrs, dict) and attrs.get("enable", True) is False:
                continue  # disables quantizers of non-linear module classes: nothing QaRL quantizes
            raise ValueError(
                f"ModelOpt entry {pattern!r} for {parent_class}: class overrides are not supported"
            )
        if isinstance(attrs, list):
            raise ValueError(
                f"ModelOpt entry {pattern!r}: multi-stage quantizers (W4A8 AWQ) are not supported"
            )
        if pattern == "*":
            if attrs.get("enable", True) is False:
                weight, act = _DISABLED, _DISABLED
            continue
        if pattern == _WEIGHT:
            weight = attrs
        elif pattern == _INPUT:
            act = attrs
        elif attrs.get("enable", True) is False:
            if pattern.endswith(("output_quantizer", "bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer")):
                continue  # KV-cache / output quantizers are disabled by default anyway
            ignore.append(_glob_to_module_regex(pattern))
        else:
            raise ValueError(f"ModelOpt entry {pattern!r}: per-module quantizer overrides are not supported")
    if weight.get("enable", True) is False or not weight:
        raise ValueError("ModelOpt config quantizes no weights ('*weight_quantizer' is off)")
    act_on = bool(act) and act.get("enable", True) is not False
    bits = _bits(weight)
    raw_blocks = weight.get("block_sizes") or {}
    blocks = {int(k) if str(k).lstrip("-").isdigit() else k: v for k, v in raw_blocks.items()}
    if blocks.get("scale_bits") is not None or blocks.get("scale_bits_mx") is not None:
        raise ValueError(f"ModelOpt block scale format {blocks} is not supported (MX/NVFP4 scales)")
    if bits == 4 and set(blocks) - {"type"} == {-1}:
        if act_on:
            raise ValueError("ModelOpt INT4 weights with quantized activations (W4A8) are not supported")
        scheme, group = "w4a16", int(blocks[-1])
    elif bits == (4, 3) and set(blocks) - {"type"} == {-1, -2}:
        if blocks[-1] != blocks[-2]:
            raise ValueError(f"ModelOpt FP8 blocks must be square, got {blocks}")
        if act_on and _bits(act) != (4, 3):
            raise ValueError("ModelOpt FP8 block weights need FP8 (4, 3) activations or none")
        scheme, group = "w8a8_fp8", int(blocks[-1])
    elif bits == 8 and not blocks and weight.get("axis") == 0:
        if act_on and _bits(act) != 8:
            raise ValueError("ModelOpt INT8 per-channel weights need INT8 activations or none")
        scheme, group = "w8a8_int8", 128
    else:
        raise ValueError(
            f"ModelOpt weight quantizer {dict(weight)} has no QaRL scheme; supported: INT4 blocks along K "
            "(w4a16), FP8 2-D blocks (w8a8_fp8), INT8 per output channel (w8a8_int8)"
        )
    merged = tuple(DEFAULT_IGNORE[scheme]) + tuple(p for p in ignore if p not in DEFAULT_IGNORE[scheme])
    return QuantConfig(scheme=scheme, group_size=group, ignore=merged)


def modelopt_fake_quant_weight(w: Tensor, mtq_cfg: Mapping[str, Any]) -> Tensor:
    """ModelOpt's own fake-quant of weight ``w_NK`` under ``mtq_cfg`` (max calibration), on ``w``'s device.

    Builds a one-layer model, runs ``mtq.quantize`` and returns ``weight_quantizer(weight)`` in ``w.dtype``.
    """
    import modelopt.torch.quantization as mtq

    n, k = w.shape
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, dtype=w.dtype, device=w.device))
    with torch.no_grad():
        model[0].weight.copy_(w)
    mtq.quantize(model, copy.deepcopy(dict(mtq_cfg)), forward_loop=lambda m: m(w.new_zeros(1, k)))
    with torch.no_grad():
        return model[0].weight_quantizer(model[0].weight)


def modelopt_int4_fake_quant(w: Tensor, group_size: int = 128) -> Tensor:
    """ModelOpt's stock INT4 fake quant (``mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG``, block ``group_size``)."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") == _WEIGHT:
            entry["cfg"]["block_sizes"][-1] = group_size
    return modelopt_fake_quant_weight(w, cfg)
