"""The data of the 30B run (docs/data.md): ``qarl data prepare`` turns files in the published layout, which the test
writes (no downloads here), into what configs/qwen3-30b-a3b/*.yaml read; ``qarl preflight`` and ``qarl plan --config``
name a missing data file with its config key and the row keys the loader needs, from any directory."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
from published_data import ASK, write_downloads, write_published

from megatron_qarl import cli
from megatron_qarl.data.prepare import DATASETS
from megatron_qarl.data.prompts import PromptStream
from megatron_qarl.preflight.data import data_finding
from megatron_qarl.preflight.rules import load_config

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "configs" / "qwen3-30b-a3b" / "w4a16_tbpo_2x8.yaml"


def test_prepare_makes_the_files_the_configs_read(tmp_path, capsys, tiny_model_dir):
    from transformers import AutoTokenizer

    downloads = write_downloads(tmp_path / "hf")
    assert cli.main(["data", "prepare", "--from", str(downloads), "--to", str(tmp_path / "data")]) == 0
    report = capsys.readouterr().out
    assert "dapo-math-17k: 11 rows read" in report and "6 repeats" in report, report
    assert "2 rows of 1 prompts with conflicting answers, 1 unparseable answers left out" in report, report
    assert "aime-2024: 4 rows read" in report and "2 rows -> " in report, report
    train = tmp_path / "data" / DATASETS["dapo-math-17k"].out
    rows = pq.read_table(train).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["63", "5"]  # first order, conflicts and @@ out
    assert rows[0] == {"data_source": "math_dapo", "ability": "MATH", "extra_info": {"index": "uuid-1"},
                       "reward_model": {"ground_truth": "63", "style": "rule-lighteval/MATH_v2"},
                       "prompt": [{"role": "user", "content": "Q: 56+7= A:\n\nPlease reason step by step, and put "
                                   "your final answer within \\boxed{}."}]}
    record = json.loads((train.parent / "prepare.json").read_text())
    assert (record["read"], record["repeated"], record["conflicting"], record["unparseable"], record["kept"]) == (
        11, 6, 2, 1, 2)
    # the configs read exactly these files under the repository's data/ (their paths are relative to them)
    cfg = load_config(QWEN)
    assert (cfg.data.source, cfg.train.eval.data.source) == (
        str(REPO / "data" / DATASETS["dapo-math-17k"].out), str(REPO / "data" / DATASETS["aime-2024"].out))
    # ... with their keys, through the loader the run uses
    cfg = load_config(QWEN, [f"data.source={train}", f"train.eval.data.source={tmp_path / 'data' / 'aime-2024'}"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    assert PromptStream(cfg.data, tokenizer).num_prompts == 2
    assert PromptStream(cfg.train.eval.data, tokenizer).num_prompts == 2
    assert data_finding(cfg).ok, data_finding(cfg)
    # --instruction keep: the prompts as published
    assert cli.main(["data", "prepare", "--from", str(downloads / "AIME-2024"), "--to", str(tmp_path / "kept"),
                     "--instruction", "keep"]) == 0
    kept = pq.read_table(tmp_path / "kept" / DATASETS["aime-2024"].out).to_pylist()
    assert kept[0]["prompt"][0]["content"] == ASK.format("Q: 21+21= A:")


def test_prepare_stops_at_a_row_without_the_keys_naming_file_and_row(tmp_path, capsys):
    bad = write_published(tmp_path / "my-copy.parquet", [("Q: 1+1= A:", "2")], repeats=1,
                          extra=[{"prompt": [{"role": "user", "content": "Q: 2+2= A:"}], "reward_model": {}}])
    assert cli.main(["data", "prepare", "--from", str(bad), "--to", str(tmp_path / "data")]) == 2  # not a known name
    assert "no file of dapo-math-17k, aime-2024" in capsys.readouterr().err
    assert cli.main(["data", "prepare", "--from", str(bad), "--dataset", "aime-2024", "--to",
                     str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:row 1: answer 'reward_model.ground_truth' must be a string or a number, got NoneType" in err, err
    assert not (tmp_path / "data" / "aime-2024").exists()


def test_plan_and_preflight_name_the_missing_files_with_their_keys_from_outside_the_repository(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "--config", str(QWEN)]) == 0
    out = capsys.readouterr().out
    missing = str(REPO / "data" / "dapo-math-17k" / "dapo-math-17k.parquet")
    assert "=> FITS on 79.65 GiB GPUs" in out
    assert f"data.source: MISSING: {missing}: no such file or directory (rows need 'prompt' and " \
           "'reward_model.ground_truth')" in out, out
    assert f"train.eval.data.source: MISSING: {REPO / 'data' / 'aime-2024' / 'aime-2024.parquet'}" in out
    finding = data_finding(load_config(QWEN))
    assert finding.ok is False and finding.key == "data.source, train.eval.data.source", finding
    assert missing in finding.detail and "qarl data prepare" in finding.fix
    assert cli.main(["preflight", "--config", str(QWEN), "--no-round-trip"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  data [data.source, train.eval.data.source; this node's file system]: data.source: {missing}" in out
    # a file that is there but lacks the keys: the key and the row named
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "Q: 1+1= A:", "answer": "2"}) + "\n")
    finding = data_finding(load_config(QWEN, [f"data.source={bad}"]))
    assert finding.ok is False and finding.key == "data.source, train.eval.data.source"
    assert "data.source: bad.jsonl:1: missing prompt key 'prompt'" in finding.detail, finding.detail


def test_the_synthetic_task_reads_no_file():
    cfg = load_config(REPO / "configs" / "cpu_default.yaml")
    assert data_finding(cfg).ok and "no files" in data_finding(cfg).detail
