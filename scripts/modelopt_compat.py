"""ModelOpt's stock fake quant of one weight, for scripts/compare_modelopt_int4.py (which imports it from here:
run it as ``python scripts/compare_modelopt_int4.py``) and tests/test_qat_modelopt.py.

ModelOpt's stock INT4 fake quant is round(w * 7/amax) / (7/amax) in fp32 with codes in [-7, 7] and an fp32 scale,
which is not what SGLang's Marlin kernel computes (bf16 scale, codes in [-8, 7]); the script measures the difference
(docs/quantization.md). The learner uses ModelOpt's quant modules with QaRL's own numerics (qat/modules.py).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

_WEIGHT = "*weight_quantizer"


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
