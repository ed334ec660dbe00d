"""``qarl data prepare --from SRC --to DIR``: the prompt files the Qwen3-30B-A3B configs read, made from a local copy
of the public dataset files (docs/data.md).

    qarl data prepare --from ~/hf/DAPO-Math-17k --from ~/hf/AIME-2024 --to data/
    qarl data prepare --from my-copy.jsonl --dataset aime-2024 --to data/

``SRC`` is a file or a folder (a Hugging Face snapshot, ``hf download ... --local-dir``) holding ``.parquet`` or
``.jsonl`` files, the formats the loader reads (``data.prompts``); a file's dataset is known by its name
(``dapo-math-17k*``, ``aime-2024*``) or given with ``--dataset``. Each dataset is written to
``DIR/<name>/<name>.parquet`` in the published layout, the file configs/qwen3-30b-a3b/*.yaml read, with a
``prepare.json`` beside it saying what was done. What is done to the rows, each counted:

- every row is parsed by the loader's own ``parse_row`` with the configs' keys (``prompt``, chat messages;
  ``reward_model.ground_truth``, else the loader's fallbacks ``answer``, ...): a row without them stops the command,
  naming its file and row; the written row has them in the published layout;
- repeated rows (the same prompt and answer) are kept once: the published DAPO-Math-17k parquet is its 17,917
  rows repeated 100 times and AIME 2024's its 30 problems 32 times (https://github.com/verl-project/verl/issues/3065);
- a prompt given with two different answers is dropped (no reward can be right for both);
- an answer math-verify cannot parse into an expression (it keeps it as text only; the reward's ``verify_boxed``
  then compares text) is dropped;
- ``--instruction boxed`` (the default): DAPO's instruction to end with a line ``Answer: ...`` is replaced by
  Qwen3's own for math, "Please reason step by step, and put your final answer within \\boxed{}." (the Qwen3 model
  cards' best practices), since the reward reads the last ``\\boxed{}`` of a response (``data.reward``); ``keep``
  leaves the prompts as published. Prompts without DAPO's wording are left as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_qarl.data.prompts import (
    SUFFIXES,
    DatasetError,
    PromptDataConfig,
    data_files,
    parse_row,
    read_rows,
    shown_path,
)
from megatron_qarl.errors import UserError


@dataclasses.dataclass(frozen=True)
class Published:
    """One public dataset the 30B configs read: where it is published, its file there and its licence as the
    dataset card states it, and where the configs read it under the ``--to`` folder."""

    name: str
    repository: str
    file: str
    licence: str

    @property
    def out(self) -> str:
        return f"{self.name}/{self.name}.parquet"


DATASETS = {d.name: d for d in (
    Published("dapo-math-17k", "https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k",
              "data/dapo-math-17k.parquet", "apache-2.0 (the dataset card's license field)"),
    Published("aime-2024", "https://huggingface.co/datasets/BytedTsinghua-SIA/AIME-2024",
              "data/aime-2024.parquet", "not stated where this project could read it: see the dataset card"),
)}
# the configs' keys (scripts/make_qwen3_30b_configs.py), read as the loader reads them: a row with its answer under a
# fallback key ("answer", ...) or a prompt given as a string is written in the published layout
KEYS = PromptDataConfig(source="published", prompt_key="prompt", answer_key="reward_model.ground_truth")
# DAPO's instruction around each problem (DAPO-Math-17k and AIME 2024 alike), and Qwen3's for math
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
BOXED_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
PARSE_TIMEOUT_S = 5  # math-verify's own bound on parsing one answer


def dataset_of(path: Path, given: str | None) -> Published | None:
    """The dataset a file holds: ``--dataset`` when given, else the one its file name starts with."""
    if given:
        return DATASETS[given]
    stem = path.name.lower().replace("_", "-")
    return next((d for name, d in DATASETS.items() if stem.startswith(name)), None)


def answer_parses(answer: str) -> bool:
    """Whether math-verify parses the ground truth, as the reward reads it (``reward._gold_latex``), into a
    mathematical expression: what it cannot parse it keeps as text only (``parse("$@@$")`` is ``["@@"]``)."""
    from math_verify import parse

    from megatron_qarl.data.reward import _gold_latex

    return any(not isinstance(x, str) for x in parse(_gold_latex(answer), parsing_timeout=PARSE_TIMEOUT_S))


def boxed_instruction(row: dict[str, Any]) -> bool:
    """Rewrite DAPO's ``Answer:`` instruction of a one-message prompt into Qwen3's ``\\boxed{}`` one, in place;
    whether it was there."""
    prompt = row.get("prompt")
    if not (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], dict)):
        return False
    text = prompt[0].get("content")
    if not (isinstance(text, str) and text.startswith(DAPO_PREFIX) and text.endswith(DAPO_SUFFIX)):
        return False
    row["prompt"] = [{**prompt[0], "content": text[len(DAPO_PREFIX):-len(DAPO_SUFFIX)] + BOXED_SUFFIX}]
    return True


@dataclasses.dataclass
class Counts:
    """What ``prepare_rows`` did, row by row."""

    read: int = 0
    repeated: int = 0
    conflicting: int = 0  # rows dropped: their prompt came with another answer too
    conflicting_prompts: int = 0
    unparseable: int = 0
    rewritten: int = 0
    kept: int = 0
    examples: list[str] = dataclasses.field(default_factory=list)

    def note(self, where: str, why: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {why}")


def prepare_rows(rows: Iterator[tuple[str, Any]], instruction: str) -> tuple[list[dict], Counts]:
    """The rows to write, in their first order, and the counts (module docstring)."""
    counts, first, answers = Counts(), {}, {}
    for where, row in rows:
        counts.read += 1
        messages, answer = parse_row(row, where, KEYS)
        prompt = json.dumps(messages, sort_keys=True)
        if (prompt, answer) in first:
            counts.repeated += 1
            continue
        answers.setdefault(prompt, set()).add(answer)
        reward_model = row.get("reward_model") if isinstance(row.get("reward_model"), dict) else {}
        first[(prompt, answer)] = (where, {**row, "prompt": messages,
                                           "reward_model": {**reward_model, "ground_truth": answer}})
    out = []
    counts.conflicting_prompts = sum(len(a) > 1 for a in answers.values())
    for (prompt, answer), (where, row) in first.items():
        if len(answers[prompt]) > 1:
            counts.conflicting += 1
            counts.note(where, f"the same prompt has the answers {sorted(answers[prompt])}: dropped")
            continue
        if not answer_parses(answer):
            counts.unparseable += 1
            counts.note(where, f"math-verify cannot parse the answer {answer!r}: dropped")
            continue
        counts.rewritten += instruction == "boxed" and boxed_instruction(row)
        out.append(row)
    counts.kept = len(out)
    return out, counts


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(dict.fromkeys(k for row in rows for k in row))  # every row's, in first-seen order
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_pydict({c: [row.get(c) for row in rows] for c in columns}), tmp)
    tmp.replace(path)


def prepare(sources: list[Path], out_dir: Path, dataset: str | None, instruction: str) -> list[str]:
    """Prepare every known dataset file under ``sources`` into ``out_dir``; the report's lines."""
    found: dict[str, list[Path]] = {}
    lines = []
    for source in sources:
        files = data_files(source) if source.exists() else []
        if not files:
            raise UserError(f"--from {source}: no such file or directory")
        for path in files:
            d = dataset_of(path, dataset)
            if d is None:
                lines.append(f"skipped {shown_path(path)}: not a file of {', '.join(DATASETS)} (--dataset names one)")
            else:
                found.setdefault(d.name, []).append(path)
    if not found:
        raise UserError(f"--from: no file of {', '.join(DATASETS)} ({' or '.join(SUFFIXES)}) under "
                        f"{', '.join(map(str, sources))}")
    for name, paths in found.items():
        d = DATASETS[name]
        rows, counts = prepare_rows((r for p in paths for r in read_rows(p)), instruction)
        if not rows:
            raise DatasetError(f"{name}: no row left of {counts.read} ({'; '.join(counts.examples)})")
        target = out_dir / d.out
        write_parquet(rows, target)
        record = {"dataset": d.name, "published": f"{d.repository} ({d.file})", "licence": d.licence,
                  "from": [str(p.resolve()) for p in paths], "sha256": [_sha256(p) for p in paths],
                  "instruction": instruction, **{k: v for k, v in dataclasses.asdict(counts).items()}}
        (target.parent / "prepare.json").write_text(json.dumps(record, indent=1) + "\n")
        lines.append(f"{name}: {counts.read:,} rows read from {', '.join(shown_path(p) for p in paths)}; "
                     f"{counts.repeated:,} repeats, {counts.conflicting} rows of {counts.conflicting_prompts} "
                     f"prompts with conflicting answers, {counts.unparseable} unparseable answers left out; "
                     f"{counts.rewritten:,} instructions rewritten to \\boxed{{}}; {counts.kept:,} rows -> "
                     f"{shown_path(target)}")
        lines += [f"  {e}" for e in counts.examples]
    return lines


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _run(args: argparse.Namespace) -> int:
    for line in prepare([Path(s).expanduser() for s in args.sources], Path(args.to).expanduser(), args.dataset,
                        args.instruction):
        print(line)
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("data", help="prompt data: prepare the 30B runs' files", description=__doc__
                                   .splitlines()[0])
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    p = sub.add_parser("prepare", help="the files configs/qwen3-30b-a3b/*.yaml read, from local copies",
                       description=__doc__.splitlines()[0], epilog=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="sources", action="append", required=True, metavar="SRC",
                   help="a downloaded file or folder of them (.parquet/.jsonl; repeatable)")
    p.add_argument("--to", required=True, metavar="DIR", help="where DIR/<name>/<name>.parquet are written (data/)")
    p.add_argument("--dataset", choices=list(DATASETS), help="the dataset of every --from file (default: by name)")
    p.add_argument("--instruction", choices=("boxed", "keep"), default="boxed",
                   help="boxed: DAPO's 'Answer:' instruction becomes Qwen3's \\boxed{} one (the reward reads the "
                        "last \\boxed{}); keep: prompts as published")
    p.set_defaults(func=_run)
    return parser
