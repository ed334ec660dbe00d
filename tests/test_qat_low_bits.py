"""Integer weight-only codes at 2 and 3 bits (QuantConfig.num_bits): the same scale rules as w4a16, codes in
[-2^(b-1), 2^(b-1) - 1], exported as int4 with the same scales, and the rollout server's 4-bit kernel holds
exactly the learner's fake-quant weights."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from quantized_checkpoint import load_quantized_checkpoint

from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.export import (
    dequantize_state_dict,
    export_state_dict,
    iter_safetensors,
)
from megatron_qarl.qat.fake_quant import fake_quant_weight
from megatron_qarl.qat.pack import pack_int4, unpack_int4
from megatron_qarl.qat.quantizer import int_code_range, quantize_w4a16, round_significant_bits

BITS = [2, 3, 4]
EXPERT = "model.layers.0.mlp.experts.0.up_proj.weight"


def _weight(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


@pytest.mark.parametrize("bits", BITS)
def test_codes_use_exactly_the_b_bit_range(bits):
    qmin, qmax = int_code_range(bits)
    assert (qmin, qmax) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    w = _weight((256, 512), seed=bits)
    qw = quantize_w4a16(w, 128, num_bits=bits, scale_bits=5)
    assert qw.codes.dtype == torch.int8
    assert int(qw.codes.min()) == qmin and int(qw.codes.max()) == qmax  # every level used, none beyond
    # the scale rule: bf16(5-significant-bit(amax / ((2^b - 1) / 2)))
    amax = w.float().reshape(256, 4, 128).abs().amax(-1)
    divisor = torch.full((1,), (2**bits - 1) / 2)
    assert torch.equal(qw.scales, round_significant_bits(amax / divisor, 5).to(torch.bfloat16))
    asym = quantize_w4a16(w, 128, symmetric=False, num_bits=bits)
    assert qmin <= int(asym.codes.min()) and int(asym.codes.max()) <= qmax
    assert qmin <= int(asym.zero_points.min()) and int(asym.zero_points.max()) <= qmax


def test_three_bit_ties_round_half_even_against_the_rounded_scale():
    s = torch.tensor(2.0**-6)
    row = torch.zeros(128)
    row[0] = 3.5 * s  # amax: scale = amax / 3.5 = s exactly; 3.5 clamps to 3
    row[1], row[2], row[3], row[4] = 2.5 * s, -2.5 * s, 1.5 * s, -3.5 * s  # -> 2, -2, 2, -4
    qw = quantize_w4a16(row[None].to(torch.bfloat16), 128, num_bits=3)
    assert qw.scales.item() == s.item()
    assert qw.codes[0, :5].tolist() == [3, 2, -2, 2, -4]


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False])
def test_learner_fake_quant_equals_the_exported_weights(bits, dtype, symmetric):
    """0 elements differ between the learner's fake-quant weight and the dequantized 4-bit export."""
    w = _weight((256, 1024), seed=10 + bits, dtype=dtype)
    cfg = QuantConfig(scheme="w4a16", num_bits=bits, symmetric=symmetric)
    w_fq, qw = fake_quant_weight(w, cfg, EXPERT)
    exported, qcfg = export_state_dict({EXPERT: w}, cfg)
    assert qcfg["config_groups"]["group_0"]["weights"]["num_bits"] == 4  # int4 containers
    assert qcfg["qarl_code_bits"] == bits
    served = dequantize_state_dict(exported, qcfg, dtype=dtype)[EXPERT]
    assert int((w_fq != served).sum()) == 0
    prefix = EXPERT.removesuffix(".weight")
    assert torch.equal(unpack_int4(exported[f"{prefix}.weight_packed"], 1024), qw.codes)
    handed, _ = export_state_dict({}, cfg, quantized={EXPERT: qw})
    assert all(torch.equal(handed[k], exported[k]) for k in exported)


def test_four_bit_export_config_is_unchanged():
    _, qcfg = export_state_dict({EXPERT: _weight((64, 128))}, QuantConfig(scheme="w4a16"))
    assert "qarl_code_bits" not in qcfg


@pytest.mark.parametrize("bits", BITS)
def test_the_servers_int4_kernel_holds_exactly_the_b_bit_weights(bits):
    """The embedded server's W4A16 layer (torch's CPU int4 mm on the exported tensors) times the identity
    gives its weight back exactly (each output is one product q * s, exact with 5-bit scales)."""
    from megatron_qarl.serve.kernels.linear import Int4Linear

    w = _weight((64, 256), seed=20 + bits, dtype=torch.float32)
    cfg = QuantConfig(scheme="w4a16", num_bits=bits, group_size=128)
    w_fq, _ = fake_quant_weight(w, cfg, EXPERT)
    exported, _ = export_state_dict({EXPERT: w}, cfg)
    prefix = EXPERT.removesuffix(".weight")
    layer = Int4Linear([prefix], dict(exported), {}, torch.float32)
    served_KN = layer.mm(torch.eye(256))
    assert torch.equal(served_KN.t(), w_fq)
    x = _weight((5, 256), seed=1, dtype=torch.float32) * 50
    torch.testing.assert_close(layer.mm(x), x @ w_fq.t(), rtol=1e-5, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(bits=st.sampled_from([2, 3]), rows=st.integers(1, 8), groups=st.integers(1, 3),
       log_scale=st.floats(-12, 4), seed=st.integers(0, 99))  # fmt: skip
def test_error_bound_and_pack_roundtrip(bits, rows, groups, log_scale, seed):
    w = (_weight((rows, 32 * groups), seed=seed).float() * 2.0**log_scale).to(torch.bfloat16)
    qw = quantize_w4a16(w, 32, num_bits=bits, scale_bits=5)
    assert torch.equal(unpack_int4(pack_int4(qw.codes), 32 * groups), qw.codes)
    step = qw.scales.float().repeat_interleave(32, 1)
    err = (qw.dequantize().float() - w.float()).abs()
    # half a step (the +amax element lands on qmax + 0.5), plus the 5-bit scale rounding (<= 1/64 relative)
    assert bool((err <= (0.5 + (2**bits) / 64) * step + 1e-30).all())


def test_fewer_bits_mean_larger_error():
    w = _weight((256, 512), seed=5, dtype=torch.float32)
    rel = [((fake_quant_weight(w, QuantConfig(scheme="w4a16", num_bits=b))[0] - w).pow(2).mean()
            / w.pow(2).mean()).item() for b in (4, 3, 2)]  # fmt: skip
    assert rel[0] < rel[1] < rel[2]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"scheme": "w4a16", "num_bits": 5}, "num_bits must be 2, 3 or 4"),
    ({"scheme": "w4a16", "num_bits": 1}, "num_bits must be 2, 3 or 4"),
    ({"scheme": "w8a8_int8", "num_bits": 3}, "num_bits.*w4a16 only"),
    ({"scheme": "w8a8_fp8", "num_bits": 2}, "num_bits.*w4a16 only"),
])  # fmt: skip
def test_bad_num_bits_is_named(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        QuantConfig(**kwargs)


def test_qarl_quantize_num_bits_on_the_tiny_model(tiny_model_dir, tmp_path, capsys):
    from megatron_qarl.cli import main

    assert main(["quantize", "--model", tiny_model_dir, "--scheme", "w4a16", "--num-bits", "3",
                 "--out", str(tmp_path / "w3")]) == 0  # fmt: skip
    assert "wrote w4a16" in capsys.readouterr().out
    qcfg = json.loads((tmp_path / "w3" / "config.json").read_text())["quantization_config"]
    assert qcfg["qarl_code_bits"] == 3
    served = load_quantized_checkpoint(tmp_path / "w3", torch.float32)
    cfg = QuantConfig(scheme="w4a16", num_bits=3)
    n = 0
    for name, tensor in iter_safetensors(tiny_model_dir):
        if ".mlp.experts." in name and name.endswith(".weight"):  # w4a16 quantizes the routed experts only
            w_fq, qw = fake_quant_weight(tensor, cfg, name)
            assert int(qw.codes.min()) >= -4 and int(qw.codes.max()) <= 3
            assert torch.equal(served[name], w_fq.float()), name
            n += 1
    assert n >= 24
