"""Prompt sets: synthetic stream, DAPO-style JSONL/Parquet, chat templates, errors with file:line, resuming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from megatron_qarl.data.math_task import MathTaskConfig, is_reserved
from megatron_qarl.data.prompts import DatasetError, PromptDataConfig, PromptStream
from megatron_qarl.data.tokenizer import build_tokenizer

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def dapo_row(question: str, truth: str) -> dict:
    """A row shaped like DAPO-Math-17k's."""
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": question}], "ability": "MATH",
            "reward_model": {"ground_truth": truth, "style": "rule"}, "extra_info": {"index": question}}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    t = build_tokenizer()
    t.chat_template = TEMPLATE
    return t


def stream(tok, source, **kw) -> PromptStream:
    return PromptStream(PromptDataConfig(source=str(source), **kw), tok)


def test_synthetic_default_matches_the_training_task(tok):
    s = PromptStream(PromptDataConfig(), tok)
    batch = s.next_batch(64)
    assert [b.source for b in batch[:3]] == ["synthetic:0", "synthetic:1", "synthetic:2"]
    for b in batch:
        a, rest = b.prompt_text.removeprefix("Q: ").split("+")
        assert b.prompt_text == f"Q: {a}+{rest}" and rest.endswith("= A:")
        c = rest.removesuffix("= A:")
        assert 2 <= len(a) <= 4 and len(a) == len(c)
        assert b.answer == str(int(a) + int(c))
        assert b.prompt_ids == tok(b.prompt_text, add_special_tokens=True)["input_ids"]
        assert not is_reserved(b.prompt_text)  # never a held-out problem
    assert len({b.prompt_text for b in batch}) > 60
    assert s.state_dict() == {"epoch": 0, "index": 64, "seed": 0}
    assert PromptStream(PromptDataConfig(), tok).next_batch(64) == batch  # a pure function of the seed


def test_synthetic_resume_gives_the_same_batches(tok):
    cfg = PromptDataConfig(synthetic=MathTaskConfig(min_digits=2, max_digits=4, seed=7))
    s = PromptStream(cfg, tok)
    s.next_batch(5)
    state = s.state_dict()
    expected = [s.next_batch(4), s.next_batch(3)]
    resumed = PromptStream(cfg, tok)
    resumed.load_state_dict(state)
    assert [resumed.next_batch(4), resumed.next_batch(3)] == expected
    other_seed = PromptStream(PromptDataConfig(), tok)
    with pytest.raises(ValueError, match="seed 7"):
        other_seed.load_state_dict(state)


def test_dapo_jsonl_rows(tmp_path, tok):
    path = write_jsonl(tmp_path / "dapo.jsonl", [
        dapo_row("Q: 12+30= A:", "42"),
        "",  # blank line: not a row, but line numbers keep counting
        {"prompt": "Q: 1+1= A:", "answer": 2},
        {"prompt": "Q: 5+5= A:", "ground_truth": " 10 "},
    ])
    samples = stream(tok, path, shuffle=False).next_batch(3)
    assert [(s.prompt_text, s.answer, s.source) for s in samples] == [
        ("Q: 12+30= A:", "42", f"{path}:1"), ("Q: 1+1= A:", "2", f"{path}:3"), ("Q: 5+5= A:", "10", f"{path}:4")]
    assert samples[0].prompt_ids == tok("Q: 12+30= A:")["input_ids"]


def test_answer_key_is_a_dotted_path_and_fallbacks_can_be_switched_off(tmp_path, tok):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "Q:", "meta": {"final": "7"}, "answer": "8"}])
    assert stream(tok, path, answer_key="meta.final").next_batch(1)[0].answer == "7"
    assert stream(tok, path).next_batch(1)[0].answer == "8"  # reward_model.ground_truth absent: fallback
    with pytest.raises(DatasetError, match="missing answer"):
        stream(tok, path, answer_fallback_keys=())


def test_chat_template_and_system_prompt(tmp_path, tok, chat_tok):
    path = write_jsonl(tmp_path / "d.jsonl", [dapo_row("Q: 1+2= A:", "3")])
    templated = stream(chat_tok, path, system_prompt="box it").next_batch(1)[0]
    assert templated.prompt_text == "<system>box it\n<user>Q: 1+2= A:\n<assistant>"
    assert templated.prompt_ids == chat_tok(templated.prompt_text, add_special_tokens=False)["input_ids"]
    plain = stream(chat_tok, path, apply_chat_template=False, system_prompt="box it").next_batch(1)[0]
    assert plain.prompt_text == "box it\n\nQ: 1+2= A:"
    assert stream(tok, path).next_batch(1)[0].prompt_text == "Q: 1+2= A:"  # no template: None means off
    with pytest.raises(DatasetError, match="no chat template"):
        stream(tok, path, apply_chat_template=True)
    synthetic = PromptStream(PromptDataConfig(), chat_tok).next_batch(1)[0]
    assert synthetic.prompt_text.startswith("<user>Q: ") and synthetic.prompt_text.endswith("<assistant>")


def test_parquet_rows_match_jsonl(tmp_path, tok):
    rows = [dapo_row(f"Q: {i}+1= A:", str(i + 1)) for i in range(5)]
    pq_path = write_parquet(tmp_path / "d.parquet", rows)
    js_path = write_jsonl(tmp_path / "d.jsonl", rows)
    from_pq = stream(tok, pq_path, shuffle=False).next_batch(5)
    from_js = stream(tok, js_path, shuffle=False).next_batch(5)
    assert [(s.prompt_text, s.prompt_ids, s.answer) for s in from_pq] == [
        (s.prompt_text, s.prompt_ids, s.answer) for s in from_js]
    assert [s.source for s in from_pq][:2] == [f"{pq_path}:row 0", f"{pq_path}:row 1"]


def test_parquet_errors_name_file_and_row(tmp_path, tok):
    rows = [dapo_row("Q: 1+1= A:", "2"), dapo_row("Q: 2+2= A:", "")]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DatasetError, match=f"{path}:row 1: answer 'reward_model.ground_truth' is empty"):
        stream(tok, path)
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(DatasetError, match=f"{fake}: not a readable Parquet file"):
        stream(tok, fake)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "Q:", "answer": "1"', "invalid JSON"),
        ('["a list"]', "a row must be a JSON object, got list"),
        ('{"question": "Q:", "answer": "1"}', "missing prompt key 'prompt'"),
        ('{"prompt": "Q:"}', "missing answer: none of the keys"),
        ('{"prompt": 5, "answer": "1"}', "'prompt' must be a string or a non-empty list"),
        ('{"prompt": [{"role": "user"}], "answer": "1"}', "'prompt' must be a string or a non-empty list"),
        ('{"prompt": "  ", "answer": "1"}', "'prompt' is empty"),
        ('{"prompt": "Q:", "answer": ["1", "2"]}', "answer 'answer' must be a string or a number, got list"),
        ('{"prompt": "Q:", "reward_model": {"ground_truth": true}}', "must be a string or a number, got bool"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, tok, bad_line, message):
    path = write_jsonl(tmp_path / "x.jsonl", [dapo_row("Q: 1+1= A:", "2"), dapo_row("Q: 2+2= A:", "4"), bad_line])
    with pytest.raises(DatasetError) as err:
        stream(tok, path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert message in str(err.value)


def test_too_long_prompts_are_skipped_and_counted_or_an_error(tmp_path, tok):
    rows = [dapo_row("Q: 1+1= A:", "2"), dapo_row("Q: 1234567+1234567= A:", "2469134"), dapo_row("Q: 3+3= A:", "6")]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    s = stream(tok, path, max_prompt_tokens=12, shuffle=False)
    assert s.num_prompts == 2
    assert [b.answer for b in s.next_batch(2)] == ["2", "6"]
    assert s.skipped.count == 1 and s.skipped.by_reason == {"too long": 1}
    assert s.skipped.examples == [f"{path}:2: too long"]
    with pytest.raises(DatasetError, match=f"{path}:2: prompt has 22 tokens > max_prompt_tokens=12"):
        stream(tok, path, max_prompt_tokens=12, too_long="error")
    with pytest.raises(DatasetError, match="no usable prompts .*1 rows skipped"):
        stream(tok, write_jsonl(tmp_path / "one.jsonl", rows[1:2]), max_prompt_tokens=12)
    with pytest.raises(DatasetError, match="synthetic:0: prompt has"):
        PromptStream(PromptDataConfig(max_prompt_tokens=5), tok).next_batch(1)


def test_empty_and_missing_sources_name_the_path(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match=f"{empty}: no usable prompts"):
        stream(tok, empty)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DatasetError, match="directory has no .jsonl or .parquet files"):
        stream(tok, tmp_path / "nothing")
    with pytest.raises(DatasetError, match="no such file or directory"):
        stream(tok, tmp_path / "absent.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        stream(tok, tmp_path / "d.csv")


def test_directory_source_reads_every_file_in_path_order(tmp_path, tok):
    write_jsonl(tmp_path / "b.jsonl", [dapo_row("Q: 2+2= A:", "4")])
    (tmp_path / "a").mkdir()
    write_parquet(tmp_path / "a" / "part-0.parquet", [dapo_row("Q: 1+1= A:", "2")])
    (tmp_path / "notes.txt").write_text("ignored")
    s = stream(tok, tmp_path, shuffle=False)
    assert s.num_prompts == 2
    assert [b.answer for b in s.next_batch(2)] == ["2", "4"]


def test_epochs_visit_every_row_once_in_a_new_order_and_resume_exactly(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [dapo_row(f"Q: {i}+0= A:", str(i)) for i in range(10)])
    s = stream(tok, path, seed=3)
    epoch0 = [b.answer for b in s.next_batch(10)]
    epoch1 = [b.answer for b in s.next_batch(10)]
    assert sorted(epoch0, key=int) == sorted(epoch1, key=int) == [str(i) for i in range(10)]
    assert epoch0 != epoch1
    assert s.state_dict() == {"epoch": 1, "index": 10, "seed": 3}

    s = stream(tok, path, seed=3)
    s.next_batch(7)
    state = s.state_dict()
    assert state == {"epoch": 0, "index": 7, "seed": 3}
    expected = [s.next_batch(4), s.next_batch(6), s.next_batch(5)]  # the first and last cross into a new epoch
    resumed = stream(tok, path, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_batch(4), resumed.next_batch(6), resumed.next_batch(5)] == expected
    assert resumed.state_dict() == s.state_dict() == {"epoch": 2, "index": 2, "seed": 3}

    assert [b.answer for b in stream(tok, path, shuffle=False).next_batch(3)] == ["0", "1", "2"]
    with pytest.raises(ValueError, match="seed 3 but the config gives 4"):
        stream(tok, path, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        resumed.load_state_dict({"epoch": 0, "index": 11, "seed": 3})


def test_config_is_strict():
    with pytest.raises(ValidationError, match="extra"):
        PromptDataConfig(answer="x")
    with pytest.raises(ValidationError):
        PromptDataConfig(too_long="truncate")
    cfg = PromptDataConfig()
    assert cfg.synthetic.min_digits == 2 and cfg.synthetic.max_digits == 4
    with pytest.raises(ValidationError):
        cfg.seed = 1
