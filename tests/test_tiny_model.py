"""The committed tiny Qwen3-MoE checkpoint: loads offline, has the required shapes, and is partly trained."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from megatron_qarl.data import evaluate as evaluate_mod
from megatron_qarl.data.tokenizer import BOS, EOS, PAD, UNK
from megatron_qarl.errors import UserError

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "train_info.json",
}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    """(model, tokenizer) loaded with the Auto classes, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    return model, tokenizer


def test_only_hf_files_and_small(tiny_model_dir):
    files = {p.name: p.stat().st_size for p in Path(tiny_model_dir).iterdir()}
    assert set(files) == EXPECTED_FILES
    assert sum(files.values()) < 20 * 2**20


def test_config_shapes(tiny_model_dir):
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["hidden_size"] == 128 and config["moe_intermediate_size"] == 128
    assert config["hidden_size"] % 128 == 0 and config["moe_intermediate_size"] % 128 == 0  # group-128 quant
    assert config["num_hidden_layers"] == 4
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 32)
    assert config["num_experts"] == 8 and config["num_experts_per_tok"] == 2  # the Qwen3-MoE spelling
    assert config["norm_topk_prob"] is True
    assert config["decoder_sparse_step"] == 1 and config["mlp_only_layers"] == []
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["max_position_embeddings"] == 128
    assert config["tie_word_embeddings"] is False
    assert config["attention_bias"] is False
    assert config["rms_norm_eps"] == 1e-6
    assert config["vocab_size"] % 8 == 0


def test_loads_with_auto_classes(loaded):
    model, tokenizer = loaded
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.num_experts == 8
    layer = model.model.layers[0]
    assert type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    assert layer.mlp.gate.weight.shape == (8, 128)
    assert layer.self_attn.q_proj.weight.shape == (4 * 32, 128)
    assert layer.self_attn.k_proj.weight.shape == (2 * 32, 128)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()  # untied
    assert len(tokenizer) <= model.config.vocab_size


def test_tokenizer(loaded):
    model, tokenizer = loaded
    assert tokenizer.convert_tokens_to_ids([PAD, EOS, BOS, UNK]) == [0, 1, 2, 3]
    assert (model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id) == (0, 1, 2)
    text = "Q: 347+589= A: 7+9=16 \\boxed{936}"
    ids = tokenizer(text).input_ids
    assert len(ids) == len(text)  # one token per character, no BOS/EOS added
    assert tokenizer.decode(ids) == text
    assert tokenizer.padding_side == "left"


def test_train_info(tiny_model_dir):
    info = json.loads((Path(tiny_model_dir) / "train_info.json").read_text())
    assert {"chosen_step", "heldout_accuracy", "seed", "command"} <= set(info)
    assert 0.2 <= info["heldout_accuracy"] <= 0.8


def test_qarl_eval(tiny_model_dir, capsys):
    """`qarl eval --json` via the subcommand's own parser: accuracy in [0.2, 0.8], as at training time."""
    parser = argparse.ArgumentParser(prog="qarl")
    evaluate_mod.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", "--model", tiny_model_dir, "--n", "200", "--json"])
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 200
    assert 0.2 <= result["accuracy"] <= 0.8
    info = json.loads((Path(tiny_model_dir) / "train_info.json").read_text())
    assert result["accuracy"] == pytest.approx(info["heldout_accuracy"], abs=0.02)


def test_eval_rejects_a_directory_without_config(tmp_path):
    with pytest.raises(UserError, match=str(tmp_path / "config.json")):
        evaluate_mod.evaluate_dir(tmp_path)
    with pytest.raises(UserError, match="--n"):
        evaluate_mod.evaluate_dir(tmp_path, n=0)


def test_committed_tokenizer_matches_the_code(tiny_model_dir, tmp_path):
    from megatron_qarl.data.tokenizer import build_tokenizer, save_tokenizer

    save_tokenizer(build_tokenizer(), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        committed = json.loads((Path(tiny_model_dir) / name).read_text())
        assert json.loads((tmp_path / name).read_text()) == committed


@pytest.mark.e2e
def test_make_tiny_model_script_runs(tmp_path):
    """Two training steps and one small evaluation: the script writes the HF files and train_info.json."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_model.py"
    out = tmp_path / "tiny"
    cmd = [sys.executable, str(script), "--out", str(out), "--max-steps", "2", "--eval-n", "8", "--seed", "3"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    assert {p.name for p in out.iterdir()} == EXPECTED_FILES
    info = json.loads((out / "train_info.json").read_text())
    assert (info["chosen_step"], info["seed"], info["heldout_n"]) == (2, 3, 8)
    assert "--max-steps 2" in info["command"]


def test_the_rollout_tests_fail_loudly_without_the_checkpoint(tmp_path, monkeypatch):
    """No random stand-in: the rollout tests' copy of the tiny checkpoint fails naming the missing file."""
    import conftest

    monkeypatch.setattr(conftest, "TINY_MODEL", tmp_path / "gone")
    with pytest.raises(pytest.fail.Exception, match=r"gone/model\.safetensors is missing"):
        conftest._private_tiny_copy(tmp_path)
