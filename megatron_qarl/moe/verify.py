"""`qarl convert verify`: load a Hugging Face checkpoint into the sharded Megatron model and check it.

Starts tp*ep-compatible local ranks (gloo on CPU), runs the Megatron model and transformers'
Qwen3MoeForCausalLM on the same tokens, and reports the largest absolute logit difference and
whether Hugging Face -> Megatron -> Hugging Face gives back every tensor exactly.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from megatron_qarl.errors import UserError


def verify_rank(model_dir: str, tp: int, ep: int, batch: int, seq: int, seed: int,
                experts: str = "grouped") -> dict | None:
    """Body run on every rank; rank 0 returns the report."""
    import torch.distributed as dist

    from megatron_qarl.moe.convert import SafetensorsDir, iter_hf_tensors, load_hf_into_model
    from megatron_qarl.moe.model import Qwen3MoeArch, build_model, forward_logits
    from megatron_qarl.moe.parallelize import init_parallel

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep, seed=seed)
    model = build_model(arch, tp=tp, ep=ep, experts=experts)
    hf = SafetensorsDir(model_dir)
    load_hf_into_model(model, arch, hf)
    model.eval()
    tokens = torch.randint(0, arch.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = forward_logits(model, tokens).float()
    exported = dict(iter_hf_tensors(model, arch))
    if dist.get_rank() != 0:
        return None
    differ = sorted(k for k in hf.keys() if k not in exported or not torch.equal(exported[k], hf[k]))
    extra = sorted(set(exported) - set(hf.keys()))
    ref = reference_logits(model_dir, tokens)
    return {
        "model": model_dir, "tp": tp, "ep": ep, "experts": experts, "world_size": dist.get_world_size(),
        "tokens": list(tokens.shape),
        "max_abs_logit_diff": (logits - ref).abs().max().item(),
        "round_trip_exact": not differ and not extra,
        "round_trip_tensors": len(hf.keys()), "round_trip_differ": differ[:10], "round_trip_extra": extra[:10],
    }


def reference_logits(model_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3MoeForCausalLM logits in fp32."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_model.eval()
    with torch.no_grad():
        return hf_model(input_ids=tokens).logits.float()


def world_size(tp: int, ep: int) -> int:
    """Smallest world in which both the dense layers (TP) and the experts (EP, expert-TP 1) fit."""
    return tp * ep // math.gcd(tp, ep)


def run(model_dir: str, tp: int, ep: int, *, batch: int = 2, seq: int = 32, seed: int = 0,
        experts: str = "grouped") -> dict:
    from megatron_qarl.moe.model_dir import check_model_dir
    from megatron_qarl.moe.parallelize import run_ranks

    arch = check_model_dir(model_dir)  # config.json and every weight file, before any rank starts
    check_layout(arch, tp, ep)
    if seq % tp:
        raise UserError(f"--seq {seq} must be divisible by --tp {tp} (sequence parallel)")
    return run_ranks(world_size(tp, ep), verify_rank, model_dir, tp, ep, batch, seq, seed, experts)[0]


def check_layout(arch, tp: int, ep: int) -> None:
    """Raise UserError naming the flag when a layout cannot shard the model."""
    for flag, value in (("--tp", tp), ("--ep", ep)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if arch.num_attention_heads % tp or arch.num_key_value_heads % tp:
        raise UserError(f"--tp {tp} must divide num_attention_heads {arch.num_attention_heads} "
                        f"and num_key_value_heads {arch.num_key_value_heads}")
    if arch.vocab_size % tp:
        raise UserError(f"--tp {tp} must divide vocab_size {arch.vocab_size}")
    if arch.num_experts % ep:
        raise UserError(f"--ep {ep} must divide num_experts {arch.num_experts}")


def _cmd_verify(args: argparse.Namespace) -> int:
    if not (Path(args.model) / "config.json").is_file():
        raise UserError(f"--model {args.model}: no config.json there")
    report = run(args.model, args.tp, args.ep, batch=args.batch, seq=args.seq, seed=args.seed, experts=args.experts)
    ok = report["max_abs_logit_diff"] <= args.tol and report["round_trip_exact"]
    report["tolerance"] = args.tol
    report["ok"] = ok
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"tp={args.tp} ep={args.ep} experts={args.experts} (world {report['world_size']}): max |logit diff| "
              f"{report['max_abs_logit_diff']:.3e} (tolerance {args.tol:g}); round trip "
              f"{'exact' if report['round_trip_exact'] else 'DIFFERS: ' + str(report['round_trip_differ'])} "
              f"over {report['round_trip_tensors']} tensors")
    return 0 if ok else 1


def register(subparsers) -> None:
    convert = subparsers.add_parser("convert", help="Hugging Face <-> Megatron conversion tools")
    sub = convert.add_subparsers(dest="convert_command", required=True, metavar="ACTION")
    p = sub.add_parser("verify", help="check a conversion: Megatron vs transformers logits, round trip")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", choices=("grouped", "sequential"), default="grouped",
                   help="the local spec's experts (model.experts): grouped (the CPU learner's) or Megatron's "
                        "SequentialMLP")
    p.add_argument("--tol", type=float, default=1e-4, help="max |logit diff| allowed (exit 1 above)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_verify)
