"""Which weights QaRL quantizes, and how: one typed config shared by the learner and the exporter.

Module names are Hugging Face names without the parameter suffix (``model.layers.3.mlp.experts.7.up_proj``).
``targets`` and ``ignore`` follow compressed-tensors, with one widening for plain entries:

- ``"Linear"``: every linear layer the caller asks about (the caller only asks about 2-D ``.weight``
  tensors of linear layers; this is how compressed-tensors and SGLang read the same word).
- ``"re:<regex>"``: ``re.match`` against the full module name (anchored at the start, as in both
  compressed-tensors and SGLang; end it with ``$`` to anchor the end).
- any other string: a module-name suffix on a dot boundary: ``"lm_head"`` matches ``lm_head`` and
  ``model.lm_head``, never ``my_lm_head``.

A module is quantized when it matches a target and no ignore entry (``is_quantized``). The default
ignore lists are regexes, so that they mean the same in compressed-tensors (exact or regex) and in
SGLang (substring or regex) once written to config.json.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Scheme = Literal["bf16", "w4a16", "w8a8_fp8", "w8a8_int8"]
SCHEMES: tuple[str, ...] = ("bf16", "w4a16", "w8a8_fp8", "w8a8_int8")
QUANTIZED_SCHEMES: tuple[str, ...] = ("w4a16", "w8a8_fp8", "w8a8_int8")

# Never quantized by any scheme: the router gate MUST stay BF16 (slime#1539: garbled output otherwise),
# embeddings and lm_head stay BF16 in every SGLang recipe, norms are not linear layers.
_ALWAYS_IGNORE: tuple[str, ...] = (
    "lm_head",
    r"re:.*embed_tokens$",
    r"re:.*mlp\.gate$",  # Qwen3-MoE / Qwen2-MoE router (not mlp.gate_proj of a dense MLP)
    r"re:.*shared_expert_gate$",  # Qwen2-MoE shared-expert gate
    r"re:.*norm$",  # input_layernorm, post_attention_layernorm, q_norm, k_norm, model.norm
)

# W4A16 quantizes the routed experts only (decode is memory-bound there; attention stays BF16).
_W4A16_IGNORE: tuple[str, ...] = _ALWAYS_IGNORE + (
    r"re:.*self_attn\..*",  # q/k/v/o_proj, and SGLang's fused qkv_proj
    r"re:.*shared_expert\..*",  # shared experts (Qwen2-MoE)
    r"re:.*mlp\.(gate|up|down)_proj$",  # dense MLP layers (mlp_only_layers); experts are mlp.experts.E.*
)

DEFAULT_IGNORE: dict[str, tuple[str, ...]] = {
    "bf16": (),
    "w4a16": _W4A16_IGNORE,
    "w8a8_fp8": _ALWAYS_IGNORE,  # attention, experts (and shared experts) quantized
    "w8a8_int8": _ALWAYS_IGNORE,
}


class QuantConfig(BaseModel):
    """The quantization scheme of a QaRL run (``bf16`` = quantization off).

    Fields:
        scheme: ``w4a16`` int4 weights per group along K, BF16 activations (SGLang compressed-tensors
            pack-quantized, Marlin); ``w8a8_fp8`` e4m3 weights in ``group_size`` x ``group_size`` blocks,
            activations per token per group of ``group_size`` (SGLang ``fp8`` block); ``w8a8_int8`` int8
            weights per output channel, activations per token (SGLang ``w8a8_int8``).
        group_size: w4a16 group along K; w8a8_fp8 weight block edge and activation group. Unused for int8.
        symmetric: w4a16 only may be asymmetric (a zero point per group); SGLang's MoE Marlin path loads
            symmetric checkpoints only.
        num_bits: weight bits of the integer weight-only scheme w4a16: 4 (default), or 3 / 2 for a bit-width
            study (same scale rules with b-bit codes, ``quantizer.quantize_w4a16``). The export stays 4-bit:
            b-bit codes are stored as int4 values with their scales, so a 4-bit kernel computes exactly the
            b-bit weights. w8a8 schemes have 8-bit weights: num_bits must stay 4 (unused) there.
        targets, ignore: module selection (see the module docstring). ``ignore=None`` takes the scheme's
            default list (``DEFAULT_IGNORE``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheme: Scheme = "bf16"
    group_size: int = 128
    symmetric: bool = True
    num_bits: int = 4
    # w4a16 symmetric: significant bits kept in the bf16 scale. 5 makes every (q * s) exact in bf16
    # (a code |q| <= 8 has at most 3 significant bits; 5 + 3 = 8, bf16's precision), so Marlin's bf16
    # rounding, an fp32 CPU kernel and the learner all get the same weight values ("kernel-invariant");
    # None keeps all 8 bits of bf16 (then only kernels that round the product to bf16, like Marlin, match
    # exactly). At num_bits 3 / 2 the codes have at most 2 / 1 significant bits: 5 stays exact.
    scale_bits: int | None = 5
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] | None = Field(default=None)

    @field_validator("scale_bits")
    @classmethod
    def _check_scale_bits(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= 8:
            raise ValueError(f"scale_bits must be in 1..8 (bf16 has 8 significant bits) or null, got {value}")
        return value

    @field_validator("group_size")
    @classmethod
    def _check_group_size(cls, value: int) -> int:
        if value <= 0 or value % 8:
            raise ValueError(f"group_size must be a positive multiple of 8 (int4 packing), got {value}")
        return value

    @field_validator("num_bits")
    @classmethod
    def _check_num_bits(cls, value: int) -> int:
        if value not in (2, 3, 4):
            raise ValueError(f"num_bits must be 2, 3 or 4 (integer codes stored as int4), got {value}")
        return value

    @field_validator("targets", "ignore")
    @classmethod
    def _check_patterns(cls, value: tuple[str, ...] | None, info) -> tuple[str, ...] | None:
        for entry in value or ():
            if not entry:
                raise ValueError(f"{info.field_name}: empty entry")
            if entry.startswith("re:"):
                try:
                    re.compile(entry[3:])
                except re.error as err:
                    raise ValueError(f"{info.field_name}: bad regex {entry!r}: {err}") from None
        return value

    @model_validator(mode="after")
    def _check_scheme_options(self) -> QuantConfig:
        if self.scheme in ("w8a8_fp8", "w8a8_int8") and not self.symmetric:
            raise ValueError(f"symmetric: {self.scheme} is symmetric only (SGLang has no zero points there)")
        if self.scheme in ("w8a8_fp8", "w8a8_int8") and self.num_bits != 4:
            raise ValueError(f"num_bits: applies to w4a16 only ({self.scheme} weights are 8-bit), "
                             f"got {self.num_bits}")
        if self.scheme != "bf16" and not self.targets:
            raise ValueError("targets: empty, nothing would be quantized")
        return self

    @property
    def enabled(self) -> bool:
        return self.scheme != "bf16"

    @property
    def ignore_list(self) -> tuple[str, ...]:
        """The ignore entries in force: the explicit list, or the scheme's default."""
        return DEFAULT_IGNORE[self.scheme] if self.ignore is None else self.ignore


def name_matches(module_name: str, pattern: str) -> bool:
    """True when ``pattern`` (``"Linear"``, ``"re:<regex>"`` or a dotted suffix) selects ``module_name``."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module_name) is not None
    return module_name == pattern or module_name.endswith("." + pattern)


def is_quantized(hf_module_name: str, cfg: QuantConfig) -> bool:
    """Whether the linear layer ``hf_module_name`` is quantized under ``cfg``.

    Pass the module name (``model.layers.0.mlp.experts.3.up_proj``); a trailing ``.weight`` is stripped.
    The exporter and the Megatron wiring both decide with this one function.
    """
    if not cfg.enabled:
        return False
    name = hf_module_name.removesuffix(".weight")
    if not any(name_matches(name, t) for t in cfg.targets):
        return False
    return not any(name_matches(name, p) for p in cfg.ignore_list)


def ignore_for_config_json(cfg: QuantConfig) -> list[str]:
    """The ignore entries rewritten so compressed-tensors and SGLang read them as ``is_quantized`` does.

    Regexes pass through; ``lm_head`` (a top-level module) passes through; other plain entries are
    suffixes here but exact names in compressed-tensors and substrings in SGLang, so they become
    ``re:(.*\\.)?<name>$``.
    """
    out = []
    for entry in cfg.ignore_list:
        if entry.startswith("re:") or entry == "lm_head":
            out.append(entry)
        else:
            out.append(r"re:(.*\.)?" + re.escape(entry) + "$")
    return out


def check_scheme(scheme: str) -> str:
    """Return ``scheme`` if known, else raise ValueError listing the valid ones."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; valid: {', '.join(SCHEMES)}")
    return scheme


def quant_sequential_mlp_applies(tp: int, ep: int) -> bool:
    """Whether ModelOpt's QuantSequentialMLP converts a quantized learner's SequentialMLP: not at TP > 1 with EP > 1
    (qat/modules.py ``_sequential_mlp_as_children``). Its sharded_state_dict writes every expert under a key of its own
    (singleton_local_shards), so the grouped experts of a quantized learner do where it applies
    (moe/grouped.py ``GroupedExperts.sharded_state_dict``): the two write the same checkpoint keys at any layout."""
    return not (tp > 1 and ep > 1)
