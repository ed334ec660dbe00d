"""Export QuantizedWeights as a Hugging Face-named state dict in the formats SGLang loads, and read it back.

Per quantized linear ``P`` (HF module name; its weight is ``P.weight``):
    w4a16      P.weight_packed int32 [N, K/8], P.weight_scale bf16 [N, K/G], P.weight_shape int32 [2],
               (P.weight_zero_point int32 [ceil(N/8), K/G], packed along N, when asymmetric)
               config: compressed-tensors, format pack-quantized, group strategy, num_bits 4 (2/3-bit
               codes are int4 values; ``qarl_code_bits`` records their width)
    w8a8_fp8   P.weight float8_e4m3fn [N, K], P.weight_scale_inv fp32 [ceil(N/B), ceil(K/B)]
               config: quant_method fp8, weight_block_size [B, B], activation_scheme dynamic
    w8a8_int8  P.weight int8 [N, K], P.weight_scale fp32 [N, 1]
               config: quant_method w8a8_int8 (compressed-tensors-style config_groups: channel / token); for
               vLLM (``engine="vllm"``, which has no w8a8_int8 method) the same tensors with quant_method
               compressed-tensors, format int-quantized
Every other tensor passes through unchanged. The codes and scales come from the caller's
QuantizedWeights (the ones its forward used) or, for weights it did not hand over, from
``quantizer.quantize_weight`` (the same function the forward calls).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from megatron_qarl.errors import UserError
from megatron_qarl.moe.model_dir import WEIGHT_INDEX, check_weights
from megatron_qarl.qat.config import QuantConfig, ignore_for_config_json, is_quantized
from megatron_qarl.qat.pack import pack_int4, unpack_int4
from megatron_qarl.qat.quantizer import QuantizedWeight, quantize_weight


def is_linear_weight(name: str, tensor: Tensor) -> bool:
    """A 2-D ``*.weight`` tensor: the only tensors the exporter considers for quantization."""
    return name.endswith(".weight") and tensor.ndim == 2


def to_sglang_tensors(prefix: str, qw: QuantizedWeight, weight_shape: Tensor | None = None) -> dict[str, Tensor]:
    """The tensors of one quantized linear ``prefix`` in SGLang's checkpoint format for ``qw.scheme``, all on the
    device of ``qw.codes`` (a weight sync all-gathers and broadcasts them together). ``weight_shape``: W4A16's
    int32 [2] shape tensor, when the caller made it once for many weights of that shape (the weight sync: one per
    stack; each fresh ``torch.tensor(shape, device=...)`` is a host-to-device copy that waits for the stream)."""
    if qw.scheme == "w4a16":
        out = {
            f"{prefix}.weight_packed": pack_int4(qw.codes),
            f"{prefix}.weight_scale": qw.scales.to(torch.bfloat16).contiguous(),
            f"{prefix}.weight_shape": weight_shape if weight_shape is not None else
            torch.tensor(qw.shape, dtype=torch.int32, device=qw.codes.device),
        }
        if qw.zero_points is not None:
            out[f"{prefix}.weight_zero_point"] = pack_int4(qw.zero_points, packed_dim=0)
        return out
    if qw.scheme == "w8a8_fp8":
        return {f"{prefix}.weight": qw.codes, f"{prefix}.weight_scale_inv": qw.scales.float().contiguous()}
    if qw.scheme == "w8a8_int8":
        return {f"{prefix}.weight": qw.codes, f"{prefix}.weight_scale": qw.scales.float().contiguous()}
    raise ValueError(f"{prefix}: cannot export scheme {qw.scheme!r}")


def from_sglang_tensors(
    prefix: str, tensors: Mapping[str, Tensor], scheme: str, group_size: int | None
) -> QuantizedWeight:
    """Inverse of ``to_sglang_tensors``: rebuild the QuantizedWeight of ``prefix`` from checkpoint tensors."""
    if scheme == "w4a16":
        n, k = (int(v) for v in tensors[f"{prefix}.weight_shape"].tolist())
        scales = tensors[f"{prefix}.weight_scale"]
        g = k // scales.shape[-1]
        codes = unpack_int4(tensors[f"{prefix}.weight_packed"], k)
        zp = tensors.get(f"{prefix}.weight_zero_point")
        zeros = unpack_int4(zp, n, packed_dim=0) if zp is not None else None
        return QuantizedWeight(codes, scales, zeros, (n, k), scheme, g)
    if scheme == "w8a8_fp8":
        codes = tensors[f"{prefix}.weight"]
        scale = tensors[f"{prefix}.weight_scale_inv"].float()
        return QuantizedWeight(codes, scale, None, tuple(codes.shape), scheme, group_size)
    if scheme == "w8a8_int8":
        codes = tensors[f"{prefix}.weight"]
        scale = tensors[f"{prefix}.weight_scale"].float().reshape(-1, 1)
        return QuantizedWeight(codes, scale, None, tuple(codes.shape), scheme, None)
    raise ValueError(f"{prefix}: unknown scheme {scheme!r}")


def quantization_config(cfg: QuantConfig, ignored_modules: list[str], engine: str = "sglang") -> dict:
    """The ``quantization_config`` entry of config.json that SGLang (``engine``) reads for ``cfg.scheme``; with
    ``engine="vllm"``, W8A8-INT8 is written as compressed-tensors int-quantized, the only INT8 config vLLM 0.32
    loads (the tensors are the same); the other schemes are the same for both engines.

    ``ignored_modules``: full names of the linear layers left in BF16 (listed explicitly for the fp8
    format, whose SGLang loader matches names; the others carry ``cfg``'s regexes, read by both
    compressed-tensors and SGLang).
    """
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    if cfg.scheme == "w4a16":
        # num_bits 4 whatever cfg.num_bits is: 2/3-bit codes are stored as int4 values (same scales), and
        # SGLang's 4-bit kernel computes exactly the 2/3-bit weights; qarl_code_bits records the width
        weights = QuantizationArgs(
            num_bits=4, type="int", symmetric=cfg.symmetric, strategy="group",
            group_size=cfg.group_size, dynamic=False,
        )  # fmt: skip
        scheme = QuantizationScheme(targets=["Linear"], weights=weights, format="pack-quantized")
        qc = QuantizationConfig(
            config_groups={"group_0": scheme}, quant_method="compressed-tensors", format="pack-quantized",
            quantization_status="compressed", ignore=ignore_for_config_json(cfg),
        )  # fmt: skip
        out = qc.model_dump(mode="json")
        if cfg.num_bits != 4:  # an extra key: compressed-tensors and SGLang ignore it
            out["qarl_code_bits"] = cfg.num_bits
        return out
    if cfg.scheme == "w8a8_fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [cfg.group_size, cfg.group_size],
            "ignored_layers": sorted(ignored_modules),
        }
    if engine not in ("sglang", "vllm"):
        raise ValueError(f"engine {engine!r}: expected 'sglang' or 'vllm'")
    if cfg.scheme == "w8a8_int8":
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False)
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        group = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
        if engine == "vllm":
            qc = QuantizationConfig(config_groups={"group_0": group}, quant_method="compressed-tensors",
                                    format="int-quantized", quantization_status="compressed",
                                    ignore=ignore_for_config_json(cfg))
            return qc.model_dump(mode="json")
        # no embed_tokens entry here: SGLang's W8A8Int8Config answers an ignored prefix with
        # UnquantizedLinearMethod, which VocabParallelEmbedding refuses (it has no 'embedding' method;
        # sglang/srt/layers/quantization/w8a8_int8.py, vocab_parallel_embedding.py); an embedding is never
        # quantized by this config anyway (it gets no method, i.e. the plain embedding)
        return {
            "quant_method": "w8a8_int8",
            "config_groups": {"group_0": group.model_dump(mode="json")},
            "ignore": [e for e in ignore_for_config_json(cfg) if not e.endswith("embed_tokens$")],
        }
    raise ValueError(f"scheme {cfg.scheme!r} has no quantization_config (quantization is off)")


def _export_one(name: str, tensor: Tensor, cfg: QuantConfig, out: dict, ignored: list[str]) -> None:
    """Add ``name``'s SGLang-format tensors to ``out``; record BF16-kept linears in ``ignored``."""
    prefix = name.removesuffix(".weight")
    if is_linear_weight(name, tensor) and is_quantized(prefix, cfg):
        out.update(to_sglang_tensors(prefix, quantize_weight(tensor, cfg, name)))
        return
    if is_linear_weight(name, tensor):
        ignored.append(prefix)
    out[name] = tensor


def export_state_dict(
    state_dict: Mapping[str, Tensor],
    cfg: QuantConfig,
    quantized: Mapping[str, QuantizedWeight] | None = None,
) -> tuple[dict[str, Tensor], dict]:
    """HF-named state dict + QuantConfig -> (SGLang-format state dict, quantization_config dict).

    ``quantized`` maps HF weight names (``...up_proj.weight``) to the QuantizedWeights the learner's
    forward used; those are exported as they are (their BF16 tensor may be absent from ``state_dict``).
    Weights that ``is_quantized`` selects but that were not handed over are quantized here with
    ``quantize_weight``; the rest pass through.
    """
    if not cfg.enabled:
        raise ValueError("scheme bf16 means quantization is off; nothing to export")
    quantized = dict(quantized or {})
    out: dict[str, Tensor] = {}
    ignored: list[str] = []
    for name, qw in sorted(quantized.items()):
        if not is_quantized(name, cfg):
            raise ValueError(
                f"{name}: handed over as quantized, but {cfg.scheme} config does not quantize it"
            )
        if qw.scheme != cfg.scheme:
            raise ValueError(f"{name}: QuantizedWeight scheme {qw.scheme} differs from config {cfg.scheme}")
        if name in state_dict and tuple(state_dict[name].shape) != qw.shape:
            raise ValueError(f"{name}: shape {list(state_dict[name].shape)} vs quantized {list(qw.shape)}")
        out.update(to_sglang_tensors(name.removesuffix(".weight"), qw))
    for name in sorted(set(state_dict) - set(quantized)):
        _export_one(name, state_dict[name], cfg, out, ignored)
    return out, quantization_config(cfg, ignored)


def dequantize_state_dict(
    tensors: Mapping[str, Tensor], quant_cfg: Mapping, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """SGLang-format tensors + config.json ``quantization_config`` -> HF name -> dequantized tensor.

    ``dtype=None``: w4a16 weights in bf16 (Marlin's values), w8a8 weights in fp32 (q * s); others as stored.
    """
    scheme, group = scheme_of(quant_cfg)
    out: dict[str, Tensor] = {}
    if scheme == "w4a16":
        prefixes = {n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")}
        own = {".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point"}
    elif scheme == "w8a8_fp8":
        prefixes = {n.removesuffix(".weight_scale_inv") for n in tensors if n.endswith(".weight_scale_inv")}
        own = {".weight", ".weight_scale_inv"}
    else:
        prefixes = {n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")}
        own = {".weight", ".weight_scale"}
    for p in prefixes:
        out[f"{p}.weight"] = from_sglang_tensors(p, tensors, scheme, group).dequantize(dtype)
    for name, tensor in tensors.items():
        prefix, dot, param = name.rpartition(".")
        if not (prefix in prefixes and dot + param in own):
            out[name] = tensor
    return out


def scheme_of(quant_cfg: Mapping) -> tuple[str, int | None]:
    """(scheme, group/block size) of a config.json ``quantization_config`` this module writes."""
    method = quant_cfg.get("quant_method")
    if method == "compressed-tensors" and quant_cfg.get("format") == "pack-quantized":
        groups = list(quant_cfg.get("config_groups", {}).values())
        return "w4a16", (groups[0]["weights"].get("group_size") if groups else None)
    if method == "fp8":
        block = quant_cfg.get("weight_block_size")
        if not block or block[0] != block[1]:
            raise ValueError(f"fp8 checkpoint without square weight_block_size: {block}")
        return "w8a8_fp8", int(block[0])
    if method == "w8a8_int8" or (method == "compressed-tensors" and quant_cfg.get("format") == "int-quantized"):
        return "w8a8_int8", None
    raise ValueError(
        f"unsupported quantization_config (quant_method={method!r}, format={quant_cfg.get('format')!r}); "
        "readable: compressed-tensors pack-quantized or int-quantized, fp8 (block), w8a8_int8"
    )


# ------------------------------------------------------------------------------------- checkpoint files
_SKIP_COPY = {"config.json", WEIGHT_INDEX}


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) over every weight file of an HF checkpoint directory, one tensor at a time; every file is
    checked before the first tensor is read (``moe.model_dir.check_weights``: a UserError naming a truncated or
    corrupt shard, or an index naming a missing one)."""
    from safetensors import SafetensorError

    for path in check_weights(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, f.get_tensor(name)
        except SafetensorError as err:
            raise UserError(f"{path}: unreadable safetensors file: {err}") from None


def _save_sharded(tensors: dict[str, Tensor], out_dir: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name].contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / WEIGHT_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def quantize_checkpoint(
    model_dir: str | Path,
    scheme: str,
    out_dir: str | Path,
    group_size: int = 128,
    symmetric: bool = True,
    max_shard_bytes: int = 5 * 2**30,
    num_bits: int = 4,
    scale_bits: int | None = QuantConfig.model_fields["scale_bits"].default,
    engine: str = "sglang",
) -> Path:
    """Quantize a BF16 HF checkpoint into the SGLang format of ``scheme``; returns ``out_dir``. ``engine="vllm"``:
    the config.json vLLM loads (``quantization_config``).

    ``num_bits`` / ``scale_bits``: see ``QuantConfig`` (w4a16 only; 2/3-bit codes are written as int4).

    Writes config.json (the source's, plus ``quantization_config``), model.safetensors (sharded with an
    index above ``max_shard_bytes``) and copies every other file (tokenizer, generation config, ...).
    """
    src, dst = Path(model_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src}: not a Hugging Face model directory (no config.json)")
    if dst.resolve() == src.resolve():
        raise ValueError(f"--out {dst} must differ from --model")
    cfg = QuantConfig(scheme=scheme, group_size=group_size, symmetric=symmetric, num_bits=num_bits,
                      scale_bits=scale_bits)
    if not cfg.enabled:
        raise ValueError("scheme bf16 means quantization is off; choose w4a16, w8a8_fp8 or w8a8_int8")
    config = json.loads((src / "config.json").read_text())
    out: dict[str, Tensor] = {}
    ignored: list[str] = []
    for name, tensor in iter_safetensors(src):  # one BF16 tensor in memory at a time
        _export_one(name, tensor, cfg, out, ignored)
    qcfg = quantization_config(cfg, ignored, engine)
    dst.mkdir(parents=True, exist_ok=True)
    for stale in list(dst.glob("*.safetensors")) + [dst / WEIGHT_INDEX]:
        stale.unlink(missing_ok=True)
    _save_sharded(out, dst, max_shard_bytes)
    config["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in _SKIP_COPY:
            shutil.copy2(path, dst / path.name)
    return dst
