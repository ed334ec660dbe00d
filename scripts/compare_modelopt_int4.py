"""Measure ModelOpt's stock fake quant against the weights SGLang serves from QaRL's exported checkpoint.

    .venv/bin/python scripts/compare_modelopt_int4.py [--model checkpoints/tiny-qwen3-moe] [--seed 0]

For each shape (random bf16 weights, N(0, 0.02^2)) it prints, per element of the weight:
- ours vs served: QaRL's fake-quant weight vs the dequantized exported tensor (SGLang's Marlin value);
- ModelOpt vs served: ModelOpt's INT4_BLOCKWISE_WEIGHT_ONLY_CFG fake quant (max calibration) vs the same;
- ModelOpt vs its own codes served: ModelOpt's fake quant vs bf16(q_m * bf16(amax/7)), what SGLang would
  compute from ModelOpt's own codes once the scale is stored in bf16 (the two-implementations problem);
- the relative MSE to the BF16 weight of ours (amax/7.5), of the amax/7 variant and of ModelOpt;
- FP8: ModelOpt's FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG vs ours (both e4m3, 128 x 128 blocks).
"""

from __future__ import annotations

import argparse
import warnings

import torch
from modelopt_compat import modelopt_fake_quant_weight, modelopt_int4_fake_quant  # scripts/modelopt_compat.py

from megatron_qarl.qat.config import QuantConfig, is_quantized
from megatron_qarl.qat.export import dequantize_state_dict, export_state_dict, iter_safetensors
from megatron_qarl.qat.fake_quant import fake_quant_weight

SHAPES = [(768, 2048), (2048, 768), (4096, 2048)]


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    differ = (a != b).sum().item()
    max_abs = (a.float() - b.float()).abs().max().item()
    return f"{differ} ({differ / a.numel():.3%}), max abs diff {max_abs:.3g}"


def _rel_mse(w_fq: torch.Tensor, w: torch.Tensor) -> float:
    return ((w_fq.float() - w.float()) ** 2).mean().item() / (w.float() ** 2).mean().item()


def _amax7_variant(w: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Same recipe as ours but scale = bf16(amax / 7), codes in [-7, 7]: the alternative we did not pick."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    s = (wg.abs().amax(-1, keepdim=True) / torch.full((1,), 7.0)).to(torch.bfloat16).float()
    return (torch.round(wg / s).clamp(-7, 7) * s).to(torch.bfloat16).reshape(n, k)


def _modelopt_codes_served(w: torch.Tensor, group: int = 128) -> torch.Tensor:
    """SGLang's value from ModelOpt's codes: q_m = clamp(round(w * (7/amax)), -7, 7), scale bf16(amax/7)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    amax = wg.abs().amax(-1, keepdim=True)
    q = torch.clamp(torch.round(wg * (torch.tensor(7.0) / amax)), -7, 7)  # ModelOpt's CPU formula
    s_b = (amax / torch.tensor(7.0)).to(torch.bfloat16).float()
    return (q * s_b).to(torch.bfloat16).reshape(n, k)


def compare(name: str, w: torch.Tensor) -> None:
    import modelopt.torch.quantization as mtq

    cfg = QuantConfig(scheme="w4a16")
    ours, _ = fake_quant_weight(w, cfg, name)
    out, qcfg = export_state_dict({f"{name}.weight": w}, cfg)
    served = dequantize_state_dict(out, qcfg)[f"{name}.weight"]
    mo = modelopt_int4_fake_quant(w)
    print(
        f"| {name} {list(w.shape)} | {_diff(ours, served)} | {_diff(mo, served)} "
        f"| {_diff(mo, _modelopt_codes_served(w))} "
        f"| ours {_rel_mse(ours, w):.3e}, amax/7 {_rel_mse(_amax7_variant(w), w):.3e}, "
        f"ModelOpt {_rel_mse(mo, w):.3e} |"
    )
    fp8_ours, _ = fake_quant_weight(w, QuantConfig(scheme="w8a8_fp8"), name)
    fp8_mo = modelopt_fake_quant_weight(w, mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
    print(f"| same, FP8 e4m3 128x128: ModelOpt FP8_2D_BLOCKWISE vs ours | | {_diff(fp8_mo, fp8_ours)} | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="also compare every routed-expert weight of this HF checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(args.seed)
    print(
        "| weight | QaRL fake quant vs SGLang (exported, dequantized): elements differing, max abs diff "
        "| ModelOpt INT4 vs SGLang | ModelOpt INT4 vs SGLang from ModelOpt's own codes | rel. MSE vs BF16 |"
    )
    print("|---|---|---|---|---|")
    for n, k in SHAPES:
        compare("random", (torch.randn(n, k) * 0.02).to(torch.bfloat16))
    if args.model:
        cfg = QuantConfig(scheme="w4a16")
        weights = {n: w for n, w in iter_safetensors(args.model) if w.ndim == 2 and is_quantized(n, cfg)}
        cat = torch.cat([w.reshape(-1, 128) for w in weights.values()])  # all expert rows, K-groups of 128
        compare(f"{args.model} ({len(weights)} expert weights)", cat)


if __name__ == "__main__":
    main()
