"""``qarl quantize``: write a BF16 Hugging Face checkpoint in the low-bit format SGLang serves.

    qarl quantize --model DIR --scheme {w4a16,w8a8_fp8,w8a8_int8} --out DIR [--group-size N] [--asymmetric]
                  [--num-bits {2,3,4}]

The codes and scales come from ``quantizer.quantize_weight``, the function the learner's fake-quant
forward uses, so the served weights equal the learner's fake-quant weights element for element.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_qarl.errors import UserError
from megatron_qarl.qat.config import QUANTIZED_SCHEMES


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``quantize`` subcommand to the ``qarl`` parser."""
    parser = subparsers.add_parser(
        "quantize",
        help="quantize a BF16 HF checkpoint into SGLang's W4A16 / W8A8-FP8 / W8A8-INT8 format",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--model", required=True, type=Path, help="BF16 Hugging Face model directory")
    parser.add_argument("--scheme", required=True, help=f"one of: {', '.join(QUANTIZED_SCHEMES)}")
    parser.add_argument("--out", required=True, type=Path, help="output directory (created)")
    parser.add_argument(
        "--group-size", type=int, default=128, help="w4a16 group along K / w8a8_fp8 block edge (128)"
    )
    parser.add_argument("--asymmetric", action="store_true", help="w4a16 with zero points (not for MoE)")
    parser.add_argument("--num-bits", type=int, default=4,
                        help="w4a16 code width: 4, or 3 / 2 (stored as int4 values, served by the 4-bit kernel)")
    parser.add_argument("--engine", choices=("sglang", "vllm"), default="sglang",
                        help="whose config.json to write (vllm: INT8 as compressed-tensors int-quantized; "
                             "docs/rollout.md 'vLLM as a rollout backend')")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``qarl quantize``; bad input becomes a UserError (exit code 2 in ``megatron_qarl.cli``)."""
    from pydantic import ValidationError

    from megatron_qarl.qat.export import quantize_checkpoint

    if args.scheme not in QUANTIZED_SCHEMES:
        raise UserError(f"--scheme: unknown scheme {args.scheme!r}; valid: {', '.join(QUANTIZED_SCHEMES)}")
    if not args.model.is_dir():
        raise UserError(f"--model: {args.model} is not a directory")
    from megatron_qarl.moe.model_dir import check_model_dir

    check_model_dir(args.model)  # config.json and every weight file, before anything is written
    try:
        out = quantize_checkpoint(
            args.model, args.scheme, args.out, group_size=args.group_size, symmetric=not args.asymmetric,
            num_bits=args.num_bits, engine=args.engine,
        )
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "config"
        raise UserError(f"--{field.replace('_', '-')}: {first['msg']}") from None
    except ValueError as err:
        raise UserError(str(err)) from None
    print(f"wrote {args.scheme} checkpoint to {out}")
    return 0
