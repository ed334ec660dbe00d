"""Export to SGLang formats: `qarl quantize` output equals the learner's fake-quant weights (ours and
compressed-tensors' decompression), config.json contents, the CLI's errors."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch
from quantized_checkpoint import load_quantized_checkpoint
from safetensors.torch import load_file, save_file

from megatron_qarl.errors import UserError
from megatron_qarl.qat import cli
from megatron_qarl.qat.config import QuantConfig, is_quantized
from megatron_qarl.qat.export import (
    export_state_dict,
    is_linear_weight,
    iter_safetensors,
    quantize_checkpoint,
)
from megatron_qarl.qat.fake_quant import fake_quant_weight

TINY = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-qwen3-moe"
SCHEMES = ["w4a16", "w8a8_fp8", "w8a8_int8"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """checkpoints/tiny-qwen3-moe when present, else a random Qwen3-MoE of the same widths (hidden 128,
    moe_intermediate 128), saved by transformers with a stand-in tokenizer file."""
    if (TINY / "config.json").is_file():
        return TINY
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    (path / "tokenizer.json").write_text('{"stand-in": true}\n')
    return path


@pytest.fixture(scope="module")
def tiny_state(tiny_model) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(tiny_model))


def _quantize_via_cli(model: Path, scheme: str, out: Path, *extra: str) -> int:
    parser = argparse.ArgumentParser(prog="qarl")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["quantize", "--model", str(model), "--scheme", scheme, "--out", str(out), *extra]
    )
    return args.func(args)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_qarl_quantize_equals_fake_quant_on_tiny_model(tiny_model, tiny_state, tmp_path, scheme, capsys):
    assert _quantize_via_cli(tiny_model, scheme, tmp_path / scheme) == 0
    assert "wrote" in capsys.readouterr().out
    cfg = QuantConfig(scheme=scheme)
    served = load_quantized_checkpoint(tmp_path / scheme)  # w4a16: bf16, w8a8: fp32 q * s
    assert served.keys() == tiny_state.keys()
    n_quantized = differ = 0
    for name, w in tiny_state.items():
        if is_linear_weight(name, w) and is_quantized(name, cfg):
            w_fq, _ = fake_quant_weight(w, cfg, name)
            differ += int((w_fq != served[name].to(w.dtype)).sum())  # the module dtype's rounding
            n_quantized += 1
        else:
            assert torch.equal(served[name], w), name
    assert differ == 0
    assert n_quantized >= (24 if scheme == "w4a16" else 32)  # 2 layers x 4 experts x 3 (+ 4 attention)
    raw = load_file(tmp_path / scheme / "model.safetensors")
    assert (tmp_path / scheme / "tokenizer.json").is_file() or not (tiny_model / "tokenizer.json").is_file()
    config = json.loads((tmp_path / scheme / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    qc = config["quantization_config"]
    expert = "model.layers.0.mlp.experts.0.up_proj"
    if scheme == "w4a16":
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
        weights = qc["config_groups"]["group_0"]["weights"]
        assert (weights["num_bits"], weights["strategy"], weights["group_size"], weights["symmetric"]) == (
            4, "group", 128, True)  # fmt: skip
        assert raw[f"{expert}.weight_packed"].dtype == torch.int32
        assert raw[f"{expert}.weight_scale"].dtype == torch.bfloat16
        assert raw[f"{expert}.weight_shape"].tolist() == list(tiny_state[f"{expert}.weight"].shape)
    elif scheme == "w8a8_fp8":
        assert (qc["quant_method"], qc["weight_block_size"], qc["activation_scheme"]) == (
            "fp8",
            [128, 128],
            "dynamic",
        )
        assert raw[f"{expert}.weight"].dtype == torch.float8_e4m3fn
        assert raw[f"{expert}.weight_scale_inv"].dtype == torch.float32
        assert "model.layers.0.mlp.gate" in qc["ignored_layers"] and "lm_head" in qc["ignored_layers"]
    else:
        assert qc["quant_method"] == "w8a8_int8"
        assert raw[f"{expert}.weight"].dtype == torch.int8 and raw[f"{expert}.weight_scale"].shape[-1] == 1


@pytest.mark.parametrize(("symmetric", "num_bits"), [(True, 4), (False, 4), (True, 3), (False, 2)])
def test_compressed_tensors_decompresses_to_fake_quant(tiny_model, tiny_state, tmp_path, symmetric, num_bits):
    """Also for 2/3-bit codes, which the checkpoint stores as int4 (its config says num_bits 4)."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    out = quantize_checkpoint(tiny_model, "w4a16", tmp_path / "ct", symmetric=symmetric, num_bits=num_bits)
    decompressed = CompressedTensorsDequantizer(out, dtype=torch.bfloat16).validate(
        load_file(out / "model.safetensors")
    )
    cfg = QuantConfig(scheme="w4a16", symmetric=symmetric, num_bits=num_bits)
    assert decompressed.keys() == tiny_state.keys()
    checked = 0
    for name, w in tiny_state.items():
        if is_linear_weight(name, w) and is_quantized(name, cfg):
            w_fq = fake_quant_weight(w, cfg, name)[0]
            assert int((w_fq != decompressed[name].to(w.dtype)).sum()) == 0, name
            checked += 1
        else:
            assert torch.equal(decompressed[name], w), name
    assert checked >= 24


def _sglang_ignores(name: str, ignore: list[str]) -> bool:
    # sglang compressed_tensors/utils.py check_equal_or_regex_match: "re:" -> re.match, else substring
    return any(re.match(p[3:], name) if p.startswith("re:") else p.lower() in name.lower() for p in ignore)


def test_w4a16_config_json_ignores_gate_attention_embeddings_lm_head(tiny_model, tiny_state, tmp_path):
    from compressed_tensors.utils.match import match_name

    out = quantize_checkpoint(tiny_model, "w4a16", tmp_path / "w4")
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    modules = {n.removesuffix(".weight") for n, w in tiny_state.items() if is_linear_weight(n, w)}
    must_ignore = {
        m for m in modules if re.search(r"(mlp\.gate|self_attn\.\w+_proj|embed_tokens|lm_head)$", m)
    }
    assert {
        "lm_head",
        "model.embed_tokens",
        "model.layers.0.mlp.gate",
        "model.layers.1.self_attn.q_proj",
    } <= must_ignore
    experts = {m for m in modules if ".mlp.experts." in m}
    assert modules == must_ignore | experts
    for m in must_ignore | {"model.layers.0.self_attn.qkv_proj"}:  # SGLang's fused attention name too
        assert any(match_name(m, p) for p in ignore), m  # compressed-tensors semantics
        assert _sglang_ignores(m, ignore), m  # SGLang semantics
    for m in experts | {"model.layers.0.mlp.experts"}:  # SGLang's FusedMoE prefix
        assert not any(match_name(m, p) for p in ignore) and not _sglang_ignores(m, ignore), m


def test_export_uses_the_handed_over_codes(tiny_state):
    cfg = QuantConfig(scheme="w4a16")
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    _, qw = fake_quant_weight(tiny_state[name], cfg, name)
    flipped = type(qw)(-qw.codes.clamp(min=-7), qw.scales, None, qw.shape, qw.scheme, qw.group_size)
    out, _ = export_state_dict({k: v for k, v in tiny_state.items() if k != name}, cfg, {name: flipped})
    from megatron_qarl.qat.pack import unpack_int4

    assert torch.equal(
        unpack_int4(out[name.replace(".weight", ".weight_packed")], qw.shape[1]), flipped.codes
    )
    with pytest.raises(ValueError, match="does not quantize it"):
        export_state_dict(tiny_state, cfg, {"model.layers.0.mlp.gate.weight": qw})


def test_sharded_output_round_trips(tiny_model, tiny_state, tmp_path):
    out = quantize_checkpoint(tiny_model, "w8a8_int8", tmp_path / "sh", max_shard_bytes=200_000)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 1
    served = load_quantized_checkpoint(out, dtype=torch.bfloat16)
    assert served.keys() == tiny_state.keys()


def test_cli_errors(tiny_model, tmp_path):
    with pytest.raises(
        UserError, match=r"--scheme: unknown scheme 'int3'; valid: w4a16, w8a8_fp8, w8a8_int8"
    ):
        _quantize_via_cli(tiny_model, "int3", tmp_path / "a")
    with pytest.raises(UserError, match=r"group_size 96 does not divide K=128"):
        _quantize_via_cli(tiny_model, "w4a16", tmp_path / "b", "--group-size", "96")
    with pytest.raises(UserError, match=r"--group-size: .*positive multiple of 8"):
        _quantize_via_cli(tiny_model, "w4a16", tmp_path / "c", "--group-size", "12")
    with pytest.raises(UserError, match="not a directory"):
        _quantize_via_cli(tmp_path / "missing", "w4a16", tmp_path / "d")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((Path(tiny_model) / "config.json").read_text())  # qarl quantize takes Qwen3-MoE
    w = torch.zeros(8, 128, dtype=torch.bfloat16)
    w[0, 0] = float("inf")
    save_file({"model.layers.0.mlp.experts.0.up_proj.weight": w}, str(bad / "model.safetensors"))
    with pytest.raises(UserError, match=r"experts\.0\.up_proj\.weight: 1 non-finite"):
        _quantize_via_cli(bad, "w8a8_int8", tmp_path / "e")
