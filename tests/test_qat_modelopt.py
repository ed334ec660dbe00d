"""ModelOpt's stock INT4 fake quant (scripts/modelopt_compat.py, for scripts/compare_modelopt_int4.py) vs ours."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.fake_quant import fake_quant_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from modelopt_compat import modelopt_int4_fake_quant  # noqa: E402

# ModelOpt and Megatron warn about absent TE / Apex / tested transformers versions on import
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def mtq():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
    return mtq


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
