"""The tests' reading of a ``qarl quantize`` export: what a server loads, dequantized (the oracle the engine, the
learner's fake quant and the sync payload are compared with)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from megatron_qarl.qat.export import dequantize_state_dict, iter_safetensors


def load_quantized_checkpoint(model_dir: str | Path, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Read a checkpoint written by ``quantize_checkpoint`` (any of the three formats, or an unquantized
    one) and return HF name -> dequantized tensor (``dequantize_state_dict`` for the dtype rule)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tensors = dict(iter_safetensors(model_dir))
    quant_cfg = config.get("quantization_config")
    if quant_cfg is None:
        return tensors
    return dequantize_state_dict(tensors, quant_cfg, dtype)
