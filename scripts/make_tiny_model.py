"""Train the project's tiny Qwen3-MoE checkpoint on the synthetic math task and save it as a HF directory.

Supervised fine-tuning from random init on 2-4 digit addition with worked steps (loss on response tokens
only), evaluating greedy accuracy on the fixed 3-digit held-out split every ``--eval-every`` steps. Training
stops at the first evaluation that reaches ``--target`` and keeps the evaluated checkpoint nearest the target
(in practice that one or the one before): the model should solve some problems but not most, so RL has room
to improve it.
Stopping on the rising edge (rather than taking any nearby accuracy) avoids keeping a transient dip of an
already-better model. Deterministic for a given seed and thread count; a few minutes on 2 CPU cores.

    python scripts/make_tiny_model.py [--out checkpoints/tiny-qwen3-moe] [--seed 0]
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing the package

from megatron_qarl.data.evaluate import evaluate  # noqa: E402
from megatron_qarl.data.math_task import MathTaskConfig, Problem, heldout_problems, training_problems  # noqa: E402
from megatron_qarl.data.tokenizer import BOS, EOS, PAD, build_tokenizer, save_tokenizer  # noqa: E402

IGNORE_INDEX = -100  # label value the HF loss skips
VOCAB_MULTIPLE = 8  # pad the embedding rows so tensor-parallel sizes up to 8 divide the vocabulary


def tiny_config(tokenizer_size: int, pad_id: int, bos_id: int, eos_id: int):
    """The tiny Qwen3-MoE shape: group-128-friendly widths, TP=2-friendly heads, every layer sparse."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=-(-tokenizer_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        hidden_size=128,
        intermediate_size=128,  # dense-MLP width; unused because every layer is sparse
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        attention_bias=False,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )


def encode_batch(tokenizer, problems: list[Problem]) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + target + <eos>`` ids, attention mask, and labels on response tokens only."""
    rows, prompt_lens = [], []
    for p in problems:
        prompt_ids = tokenizer(p.prompt).input_ids
        rows.append(prompt_ids + tokenizer(p.target).input_ids + [tokenizer.eos_token_id])
        prompt_lens.append(len(prompt_ids))
    length = max(len(r) for r in rows)
    input_ids_BT = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    labels_BT = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    mask_BT = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (row, n_prompt) in enumerate(zip(rows, prompt_lens, strict=True)):
        input_ids_BT[i, : len(row)] = torch.tensor(row)
        labels_BT[i, n_prompt : len(row)] = torch.tensor(row[n_prompt:])
        mask_BT[i, : len(row)] = 1
    return {"input_ids": input_ids_BT, "attention_mask": mask_BT, "labels": labels_BT}


def write_portable_config(path: Path) -> None:
    """Spell the expert count "num_experts", as Qwen3-MoE's own config.json does.

    transformers 5 writes its internal name "num_local_experts"; transformers 4 (which inference engines may
    pin) does not know that key and would build the default 128 experts. Version 5 reads either spelling.
    """
    config = json.loads(path.read_text())
    if "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def lr_at(step: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then constant (steps count from 1)."""
    return peak * min(1.0, step / max(1, warmup))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults reproduce the committed checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "checkpoints" / "tiny-qwen3-moe")
    parser.add_argument("--seed", type=int, default=0, help="seeds model init and the training stream")
    parser.add_argument("--target", type=float, default=0.42, help="held-out accuracy to aim for")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-from", type=int, default=100, help="first step to evaluate (~0 before)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--min-digits", type=int, default=2, help="training operands' fewest digits")
    parser.add_argument("--max-digits", type=int, default=4, help="training operands' most digits")
    parser.add_argument("--eval-n", type=int, default=200, help="held-out problems per evaluation")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), *(tokenizer.convert_tokens_to_ids([PAD, BOS, EOS])))
    model = Qwen3MoeForCausalLM(config)
    model.set_experts_implementation("eager")  # fastest on CPU (calibration note)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {config.vocab_size} ({len(tokenizer)} tokens)")

    train_task = MathTaskConfig(min_digits=args.min_digits, max_digits=args.max_digits, seed=args.seed)
    eval_task = MathTaskConfig()  # the held-out split `qarl eval` uses: 3-digit addition
    eval_set = heldout_problems(eval_task, args.eval_n)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    best: dict | None = None
    history: list[dict] = []
    model.train()
    for step in range(1, args.max_steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup)
        batch = encode_batch(tokenizer, training_problems(train_task, args.batch_size, stream=step))
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step < args.eval_from or step % args.eval_every) and step != args.max_steps:
            continue
        result = evaluate(model, tokenizer, eval_set)
        elapsed = time.perf_counter() - started
        history.append({"step": step, "loss": round(loss.item(), 4), "accuracy": result.accuracy})
        print(
            f"step {step:4d}  loss {loss.item():.4f}  held-out acc {result.accuracy:.3f}  ({elapsed:.0f} s)",
            flush=True,
        )
        if best is None or abs(result.accuracy - args.target) < abs(best["accuracy"] - args.target):
            best = {"step": step, "accuracy": result.accuracy, "state": copy.deepcopy(model.state_dict())}
        if result.accuracy >= args.target:
            break

    assert best is not None
    model.load_state_dict(best.pop("state"))
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(args.out))
    write_portable_config(args.out / "config.json")
    save_tokenizer(tokenizer, args.out)
    try:
        command = shlex.join(["python", str(Path(__file__).resolve().relative_to(REPO_ROOT)), *sys.argv[1:]])
    except ValueError:
        command = shlex.join(["python", *sys.argv])
    info = {
        "chosen_step": best["step"],
        "heldout_accuracy": best["accuracy"],
        "heldout_n": len(eval_set),
        "target": args.target,
        "seed": args.seed,
        "command": command,
        "train_task": train_task.model_dump(mode="json"),
        "eval_task": eval_task.model_dump(mode="json"),
        "history": history,
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (args.out / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"kept step {best['step']} (held-out acc {best['accuracy']:.3f}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
