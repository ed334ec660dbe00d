"""Every loader of a model directory refuses a corrupt or incomplete one with a UserError naming the file (exit code 2)
before it reads a tensor or starts anything (issue 53 item 6; moe/model_dir.py). Before, a truncated shard gave a raw
``SafetensorError: invalid header length`` traceback (exit 1) from qarl train, serve, eval and convert verify alike,
naming no file."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_qarl import cli
from megatron_qarl.errors import UserError
from megatron_qarl.moe.model_dir import check_model_dir

SHARD = "model.safetensors"


def _copy(tiny_model_dir, dest):
    shutil.copytree(tiny_model_dir, dest)
    return dest


def _truncated(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "truncated")
    with open(d / SHARD, "r+b") as f:
        f.truncate((d / SHARD).stat().st_size - 1000)
    return d


def _commands(d, tmp_path) -> dict[str, list[str]]:
    """Each ``qarl`` command that loads a model directory, pointed at ``d`` (nothing else wrong)."""
    return {"train": ["train", "--config", "configs/cpu_default.yaml", f"model.path={d}", "launch.backend=local",
                      f"train.output_dir={tmp_path / 'run'}", "--no-preflight"],
            "serve": ["serve", "--model", str(d), "--port", "9"],
            "eval": ["eval", "--model", str(d)],
            "convert verify": ["convert", "verify", "--model", str(d)],
            "quantize": ["quantize", "--model", str(d), "--scheme", "w4a16", "--out", str(tmp_path / "q")]}


def test_a_truncated_shard_is_named_by_every_command_that_loads_it(tiny_model_dir, tmp_path, capsys):
    d = _truncated(tiny_model_dir, tmp_path)
    for name, argv in _commands(d, tmp_path).items():
        assert cli.main(argv) == 2, name
        err = capsys.readouterr().err
        assert f"{d / SHARD}: truncated safetensors file" in err, (name, err)
        assert "Traceback" not in err, (name, err)
    assert not (tmp_path / "q").exists() and not (tmp_path / "run").exists()  # nothing written, nothing started


@pytest.mark.parametrize("damage, message", [
    ("index naming a missing shard", r"model\.safetensors\.index\.json: names 1 shard\(s\) that .* does not hold: "
                                     r"model-00002-of-00002\.safetensors"),
    ("index naming a tensor its shard lacks", r"model\.safetensors\.index\.json: names 1 tensor\(s\) their shard does "
                                              r"not hold: model\.ghost\.weight \(model\.safetensors\)"),
    ("no weights", r"no \*\.safetensors weight files"),
    ("header cut short", r"model\.safetensors: truncated or corrupt safetensors file: 100 bytes, too few for its "
                         r"header of \d+ bytes"),
    ("a header that is no JSON", r"model\.safetensors: corrupt safetensors header"),
    ("config.json missing", r"config\.json: not found"),
    ("config.json unreadable", r"config\.json: unreadable: UnicodeDecodeError"),
    ("config.json no JSON", r"config\.json: line 1: invalid JSON"),
    ("config.json not a Qwen3-MoE", r"config\.json: not a Qwen3-MoE config: model_type is 'llama'"),
    ("config.json a list", r"config\.json: not a Qwen3-MoE config: a JSON list"),
])
def test_each_damage_is_named(damage, message, tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    shard, config = d / SHARD, d / "config.json"
    weight_map = {"model.embed_tokens.weight": SHARD}
    if damage == "index naming a missing shard":
        weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    if damage == "index naming a tensor its shard lacks":
        weight_map["model.ghost.weight"] = SHARD
    if damage.startswith("index"):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    elif damage == "no weights":
        shard.unlink()
    elif damage == "header cut short":
        with open(shard, "r+b") as f:
            f.truncate(100)
    elif damage == "a header that is no JSON":
        data = bytearray(shard.read_bytes())
        data[8:12] = b"\xff\xfe{["
        shard.write_bytes(bytes(data))
    elif damage == "config.json missing":
        config.unlink()
    elif damage == "config.json unreadable":
        config.write_bytes(b"\xff\xfe\x00garbage")
    elif damage == "config.json no JSON":
        config.write_text('{"model_type": "qwen3_moe",')
    elif damage == "config.json not a Qwen3-MoE":
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "llama"}))
    elif damage == "config.json a list":
        config.write_text("[1, 2]")
    with pytest.raises(UserError, match=message):
        check_model_dir(d)


def test_the_committed_checkpoint_and_a_sharded_export_check_out(tiny_model_dir, tmp_path):
    from megatron_qarl.qat.export import _save_sharded, iter_safetensors

    assert check_model_dir(tiny_model_dir).num_experts == 8
    tensors = dict(iter_safetensors(tiny_model_dir))
    out = _copy(tiny_model_dir, tmp_path / "sharded")
    (out / SHARD).unlink()
    _save_sharded(tensors, out, max_shard_bytes=1 << 20)
    assert len(list(out.glob("*.safetensors"))) > 2
    check_model_dir(out)
    assert sorted(dict(iter_safetensors(out))) == sorted(tensors)
