"""ModelOpt configs as an input format, ModelOpt's stock INT4 fake quant vs ours."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from megatron_qarl.qat.config import QuantConfig, is_quantized
from megatron_qarl.qat.fake_quant import fake_quant_weight
from megatron_qarl.qat.modelopt_compat import modelopt_int4_fake_quant, quant_config_from_modelopt

# ModelOpt and Megatron warn about absent TE / Apex / tested transformers versions on import
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def mtq():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
    return mtq


@pytest.mark.parametrize(
    ("name", "scheme", "group"),
    [("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "w4a16", 128), ("FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "w8a8_fp8", 128),
     ("INT8_DEFAULT_CFG", "w8a8_int8", 128), ("INT8_WEIGHT_ONLY_CFG", "w8a8_int8", 128)],
)  # fmt: skip
def test_stock_modelopt_configs_map(mtq, name, scheme, group):
    mtq_cfg = getattr(mtq, name)
    cfg = quant_config_from_modelopt(mtq_cfg)
    assert (cfg.scheme, cfg.group_size) == (scheme, group)
    # the scheme's defaults stay (router gate BF16 ...), ModelOpt's disabled modules are added
    assert not is_quantized("model.layers.0.mlp.gate", cfg) and not is_quantized("lm_head", cfg)
    assert not is_quantized("model.visual.blocks.0.mlp.fc1", cfg)
    assert is_quantized("model.layers.0.mlp.experts.3.up_proj", cfg)
    # the same config after a JSON round trip (string keys, lists for tuples) maps the same
    assert quant_config_from_modelopt(json.loads(json.dumps(mtq_cfg, default=list))) == cfg


@pytest.mark.parametrize(
    ("name", "message"),
    [("FP8_DEFAULT_CFG", "has no QaRL scheme"), ("INT4_AWQ_CFG", "algorithm 'awq_lite'"),
     ("NVFP4_DEFAULT_CFG", "NVFP4"), ("W4A8_AWQ_BETA_CFG", "awq_lite")],
)  # fmt: skip
def test_unsupported_modelopt_configs(mtq, name, message):
    with pytest.raises(ValueError, match=message):
        quant_config_from_modelopt(getattr(mtq, name))


def test_legacy_dict_form_and_group_size():
    legacy = {
        "quant_cfg": {
            "*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 64}, "enable": True},
            "*input_quantizer": {"enable": False},
            "*lm_head*": {"enable": False},
            "nn.BatchNorm1d": {"*": {"enable": False}},
            "default": {"enable": False},
        },
        "algorithm": "max",
    }
    cfg = quant_config_from_modelopt(legacy)
    assert (cfg.scheme, cfg.group_size) == ("w4a16", 64)
    with pytest.raises(ValueError, match="W4A8"):
        quant_config_from_modelopt(
            {"quant_cfg": {**legacy["quant_cfg"], "*input_quantizer": {"num_bits": 8}}}
        )
    with pytest.raises(ValueError, match="per-module quantizer overrides"):
        quant_config_from_modelopt({"quant_cfg": {**legacy["quant_cfg"], "*q_proj*": {"num_bits": 8}}})


def test_modelopt_stock_int4_differs_from_sglang_numerics(mtq):
    """ModelOpt: round(w * 7/amax) / (7/amax) in fp32, codes in [-7, 7]; not SGLang's Marlin value."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(768, 2048, generator=g) * 0.02).to(torch.bfloat16)
    mo = modelopt_int4_fake_quant(w)
    wg = w.float().reshape(768, 16, 128)
    scale = torch.tensor(7.0) / wg.abs().amax(-1, keepdim=True)
    formula = (torch.clamp(torch.round(wg * scale), -7, 7) / scale).reshape(768, 2048).to(torch.bfloat16)
    assert torch.equal(mo, formula)
    ours, _ = fake_quant_weight(w, QuantConfig(scheme="w4a16"))
    frac = (mo != ours).float().mean().item()
    assert 0.5 < frac < 0.95  # measured 84.9% (docs/quantization.md)
