"""Greedy held-out accuracy of a Hugging Face checkpoint on the synthetic math task, and `qarl eval`.

Prompts are batched with left padding and decoded greedily with transformers' ``generate`` (KV cache), so
200 three-digit problems take a few seconds on two CPU cores for the tiny model. A response is correct when
its last ``\\boxed{...}`` equals the ground truth (``math_task.exact_match_reward``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError

from megatron_qarl.data.math_task import MathTaskConfig, Problem, exact_match_reward, heldout_problems
from megatron_qarl.errors import UserError

# extra decode steps beyond the longest reference response, so a slightly longer answer can still finish
_SLACK_TOKENS = 8


@dataclass
class EvalResult:
    """Outcome of one evaluation: accuracy over ``n`` problems, and each response (in problem order)."""

    accuracy: float
    correct: int
    n: int
    responses: list[str] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, float | int]:
        """The numbers, without the responses."""
        return {k: v for k, v in asdict(self).items() if k != "responses"}


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, object]:
    """Load ``(model, tokenizer)`` from a local HF directory, offline, in eval mode on CPU.

    Raises UserError naming the path when it is not a model directory. Experts use transformers' "eager"
    implementation, the fastest on CPU for small batches.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_qarl.moe.model_dir import check_model_dir

    path = Path(model_dir)
    check_model_dir(path)  # config.json (a Qwen3-MoE) and every weight file, named when corrupt or incomplete
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, local_files_only=True, experts_implementation="eager"
    )
    return model.eval(), tokenizer


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 256
) -> list[str]:
    """Greedy continuations of ``prompts`` (special tokens stripped), decoded in left-padded batches."""
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    responses: list[str] = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True)
        if tokenizer.padding_side != "left" and not bool(batch["attention_mask"].all()):
            raise ValueError("greedy_generate needs a left-padding tokenizer for prompts of unequal length")
        out_BT = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
        )
        new_BT = out_BT[:, batch["input_ids"].shape[1] :]
        responses.extend(tokenizer.batch_decode(new_BT, skip_special_tokens=True))
    return responses


def response_budget(tokenizer, problems: list[Problem]) -> int:
    """Decode steps that let every reference response (plus EOS) finish, with a little slack."""
    longest = max(len(tokenizer(p.target).input_ids) for p in problems)
    return longest + 1 + _SLACK_TOKENS


def evaluate(model: torch.nn.Module, tokenizer, problems: list[Problem], batch_size: int = 256) -> EvalResult:
    """Greedy exact-match accuracy of ``model`` on ``problems``; restores the model's train/eval mode."""
    if not problems:
        raise ValueError("no problems to evaluate")
    was_training = model.training
    model.eval()
    try:
        responses = greedy_generate(
            model, tokenizer, [p.prompt for p in problems], response_budget(tokenizer, problems), batch_size
        )
    finally:
        model.train(was_training)
    correct = int(sum(exact_match_reward(r, p.answer) for r, p in zip(responses, problems, strict=True)))
    return EvalResult(accuracy=correct / len(problems), correct=correct, n=len(problems), responses=responses)


def evaluate_dir(model_dir: str | Path, n: int = 200, task: MathTaskConfig | None = None) -> EvalResult:
    """Greedy accuracy of the checkpoint in ``model_dir`` on the first ``n`` held-out problems of ``task``."""
    task = task or MathTaskConfig()
    if not 1 <= n <= task.heldout_size:
        raise UserError(f"--n must be in [1, {task.heldout_size}], got {n}")
    model, tokenizer = load_model(model_dir)
    return evaluate(model, tokenizer, heldout_problems(task, n))


def _run(args: argparse.Namespace) -> int:
    """`qarl eval`: print the greedy held-out accuracy (a line, or JSON with --json)."""
    torch.set_num_threads(args.threads)
    try:
        # held-out prefixes are stable, so a larger heldout_size keeps the first 200 problems the same
        task = MathTaskConfig(min_digits=args.digits, max_digits=args.digits, heldout_size=max(args.n, 200))
    except ValidationError as err:
        raise UserError(f"--digits {args.digits}: {err.errors()[0]['msg']}") from None
    result = evaluate_dir(args.model, args.n, task)
    if args.json:
        print(json.dumps({"model": str(args.model), "digits": args.digits, **result.summary()}))
    else:
        print(f"{args.model}: greedy held-out accuracy {result.accuracy:.1%} ({result.correct}/{result.n})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `qarl eval` to the `qarl` command."""
    parser = subparsers.add_parser(
        "eval",
        help="greedy held-out accuracy of a checkpoint on the synthetic math task",
        description="Print the greedy exact-match accuracy of a Hugging Face checkpoint on the fixed "
        "held-out split of the synthetic math task.",
    )
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model directory")
    parser.add_argument("--n", type=int, default=200, help="number of held-out problems (default 200)")
    parser.add_argument("--digits", type=int, default=3, help="digits per operand of the held-out problems")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    parser.set_defaults(func=_run)
