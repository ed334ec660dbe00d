"""RL prompt sets: the synthetic math task (default), or JSONL / Parquet files with DAPO-Math-17k-style rows.

A DAPO-Math-17k row::

    {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "..."}], "ability": "MATH",
     "reward_model": {"ground_truth": "34", "style": "rule"}, "extra_info": {...}}

The prompt is a list of chat messages or a plain string. The answer is read at the dotted ``answer_key``
("reward_model.ground_truth"); only when that key is absent, the top-level ``answer_fallback_keys`` are tried
in order ("answer", "ground_truth", "solution"), so plain ``{"prompt": ..., "answer": ...}`` files work too.

Prompts go through the tokenizer's chat template (``apply_chat_template``: None = when it has one), with an
optional system message; without a template the message contents are joined by blank lines and the
tokenizer adds its own special tokens. All rows are read, checked and tokenized when the stream is made,
so a bad row stops the run before training with ``file:line`` (JSONL, 1-based) or ``file:row N`` (Parquet,
0-based). A prompt over ``max_prompt_tokens`` is skipped and counted (``too_long="skip"``; ``skipped`` quotes
the first locations) or an error; for the synthetic task it is always an error (a config mistake).

``PromptStream`` yields fixed-size batches forever: file sets go epoch by epoch in a seeded order (a fresh
permutation per epoch), the synthetic task draws problem ``i`` from its own seeded stream ``i``. Its
``state_dict()`` ({"epoch", "index", "seed"}) restores the exact following batches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from megatron_qarl.data.math_task import MathTaskConfig, training_problems
from megatron_qarl.errors import UserError

SYNTHETIC = "synthetic"
SUFFIXES = (".jsonl", ".parquet")
# how many skipped rows are quoted with their file and line
MAX_SKIP_EXAMPLES = 10
# rows tokenized per tokenizer call while loading
_TOKENIZE_CHUNK = 1024


class DatasetError(UserError):
    """A prompt file or row is unusable; the message starts with the path (and line or row)."""


class PromptDataConfig(BaseModel):
    """Where RL prompts come from and how they become token ids."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(SYNTHETIC, description='"synthetic", or a .jsonl/.parquet file or a directory of them')
    prompt_key: str = Field("prompt", description="row key of the prompt (string or list of chat messages)")
    answer_key: str = Field("reward_model.ground_truth", description="dotted path of the ground-truth answer")
    answer_fallback_keys: tuple[str, ...] = Field(
        ("answer", "ground_truth", "solution"), description="keys tried in order when answer_key is absent")
    apply_chat_template: bool | None = Field(None, description="None: apply when the tokenizer has a template")
    system_prompt: str | None = Field(None, description="system message put before every prompt")
    max_prompt_tokens: int = Field(1024, ge=1, description="longest prompt, in tokens")
    too_long: Literal["skip", "error"] = Field("skip", description="what a longer prompt does")
    shuffle: bool = Field(True, description="seeded new order every epoch (file sources)")
    seed: int = Field(0, description="shuffling seed of file sources (the synthetic stream uses synthetic.seed)")
    synthetic: MathTaskConfig = Field(
        MathTaskConfig(min_digits=2, max_digits=4), description="synthetic task: the tiny model's training range")


@dataclass(frozen=True)
class PromptSample:
    """One prompt ready for rollout: its text, token ids, ground-truth answer and where it came from."""

    prompt_text: str
    prompt_ids: list[int]
    answer: str
    source: str  # "file.jsonl:12", "file.parquet:row 11" or "synthetic:42"


@dataclass
class SkipReport:
    """Rows left out of the dataset, by reason, with the first few locations quoted."""

    count: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def add(self, where: str, reason: str) -> None:
        """Count one skipped row."""
        self.count += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        if len(self.examples) < MAX_SKIP_EXAMPLES:
            self.examples.append(f"{where}: {reason}")


def data_files(source: str | Path) -> list[Path]:
    """The .jsonl/.parquet files of ``source``: the file itself, or those under a directory, sorted by path."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise DatasetError(f"{path}: directory has no {' or '.join(SUFFIXES)} files")
        return files
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory")
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use {' or '.join(SUFFIXES)}")
    return [path]


def read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(location, row)`` for every row of a JSONL or Parquet file; blank JSONL lines are not rows."""
    if path.suffix == ".parquet":
        yield from _read_parquet(path)
        return
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{number}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield f"{path}:{number}", row


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    """Rows of a Parquet file as Python dicts, batch by batch."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from e
    try:
        reader = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not Parquet
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
    index = 0
    batches = reader.iter_batches(batch_size=4096)
    while True:
        try:
            rows = next(batches).to_pylist()
        except StopIteration:
            return
        except Exception as e:  # a corrupt row group
            raise DatasetError(f"{path}:row {index}: unreadable Parquet data ({e})") from None
        for row in rows:
            yield f"{path}:row {index}", row
            index += 1


def shown_path(path: str | Path) -> str:
    """``path`` as a message shows it: relative to the current directory when it lies under it, else as it is."""
    p = Path(path)
    try:
        return str(p.relative_to(Path.cwd())) if p.is_absolute() else str(p)
    except ValueError:
        return str(p)


def inspect_source(config: PromptDataConfig) -> str:
    """What ``config.source`` holds, checked without loading it (``qarl preflight``, ``qarl plan --config``): each
    file exists, reads, and its first row has the prompt and the answer keys (``parse_row``); the rows Parquet's
    metadata counts. A ``DatasetError`` naming the file (and row) and the keys the loader reads when not."""
    if config.source == SYNTHETIC:
        return "the synthetic math task (no files)"
    keys = f"rows need {config.prompt_key!r} and {config.answer_key!r}"
    if not Path(config.source).expanduser().exists():
        raise DatasetError(f"{shown_path(config.source)}: no such file or directory ({keys})")
    files = data_files(config.source)
    rows = []
    for path in files:
        first = next(read_rows(path), None)
        if first is None:
            raise DatasetError(f"{shown_path(path)}: no rows ({keys})")
        try:
            parse_row(first[1], first[0], config)
        except DatasetError as err:
            raise DatasetError(f"{str(err).replace(str(path), shown_path(path), 1)} ({keys})") from None
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows.append(pq.ParquetFile(path).metadata.num_rows)
    count = f"{sum(rows):,} rows" if len(rows) == len(files) else "rows not counted (JSONL)"
    where = shown_path(files[0]) if len(files) == 1 else f"{len(files)} files under {shown_path(config.source)}"
    return f"{where}: {count}, the first has {config.prompt_key!r} and {config.answer_key!r}"


def lookup(row: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """``(found, value)`` of the dotted key ``a.b.c`` in nested dicts."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def parse_row(row: Any, where: str, config: PromptDataConfig) -> tuple[list[dict[str, str]], str]:
    """The chat messages and ground-truth answer of one row; ``DatasetError`` naming ``where`` if malformed."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    found, prompt = lookup(row, config.prompt_key)
    if not found:
        raise DatasetError(f"{where}: missing prompt key {config.prompt_key!r} (keys: {sorted(row)})")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise DatasetError(f"{where}: {config.prompt_key!r} must be a string or a non-empty list of "
                           f'{{"role": str, "content": str}} messages, got {_describe(prompt)}')
    if not any(m["content"].strip() for m in messages):
        raise DatasetError(f"{where}: {config.prompt_key!r} is empty")
    for key in (config.answer_key, *config.answer_fallback_keys):
        found, answer = lookup(row, key)
        if found:
            break
    else:
        keys = [config.answer_key, *config.answer_fallback_keys]
        raise DatasetError(f"{where}: missing answer: none of the keys {keys} is present")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise DatasetError(f"{where}: answer {key!r} must be a string or a number, got {_describe(answer)}")
    if not answer.strip():
        raise DatasetError(f"{where}: answer {key!r} is empty")
    return messages, answer.strip()


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _describe(value: Any) -> str:
    """A short description of a bad value for an error message."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def uses_chat_template(tokenizer: Any, config: PromptDataConfig) -> bool:
    """Whether prompts go through the tokenizer's chat template; an error if asked for one it lacks."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if config.apply_chat_template and not has_template:
        raise DatasetError("apply_chat_template is true but the tokenizer has no chat template")
    return has_template if config.apply_chat_template is None else config.apply_chat_template


def render_prompt(messages: list[dict[str, str]], tokenizer: Any, config: PromptDataConfig, templated: bool) -> str:
    """The prompt text: the chat template with a generation prompt, or the contents joined by blank lines."""
    if config.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": config.system_prompt}, *messages]
    if templated:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages)


def tokenize(texts: list[str], tokenizer: Any, templated: bool) -> list[list[int]]:
    """Token ids of each text; special tokens are the template's job when there is one, else the tokenizer's."""
    if not texts:
        return []
    return list(tokenizer(texts, add_special_tokens=not templated, verbose=False)["input_ids"])


@dataclass
class _Table:
    """The loaded rows: texts, ids (int32 arrays), answers, locations."""

    texts: list[str] = field(default_factory=list)
    ids: list[np.ndarray] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


def load_prompt_files(config: PromptDataConfig, tokenizer: Any) -> tuple[_Table, SkipReport]:
    """Read, check and tokenize every row of ``config.source``; too-long prompts per ``config.too_long``."""
    templated = uses_chat_template(tokenizer, config)
    table, skipped = _Table(), SkipReport()
    pending: list[tuple[str, str, str]] = []  # (text, answer, where) awaiting tokenization

    def flush() -> None:
        for (text, answer, where), ids in zip(pending, tokenize([p[0] for p in pending], tokenizer, templated),
                                              strict=True):
            if len(ids) > config.max_prompt_tokens:
                reason = f"prompt has {len(ids)} tokens > max_prompt_tokens={config.max_prompt_tokens}"
                if config.too_long == "error":
                    raise DatasetError(f"{where}: {reason}")
                skipped.add(where, "too long")
                continue
            table.texts.append(text)
            table.ids.append(np.asarray(ids, dtype=np.int32))
            table.answers.append(answer)
            table.sources.append(where)
        pending.clear()

    for path in data_files(config.source):
        for where, row in read_rows(path):
            messages, answer = parse_row(row, where, config)
            pending.append((render_prompt(messages, tokenizer, config, templated), answer, where))
            if len(pending) >= _TOKENIZE_CHUNK:
                flush()
    flush()
    if not table.texts:
        detail = f" ({skipped.count} rows skipped: {skipped.examples[0]})" if skipped.count else ""
        raise DatasetError(f"{config.source}: no usable prompts{detail}")
    return table, skipped


def epoch_order(size: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """The order rows are visited in ``epoch``: a permutation seeded by ``(seed, epoch)``, or 0..size-1."""
    if not shuffle:
        return np.arange(size)
    return np.random.default_rng([seed, epoch]).permutation(size)


class PromptStream:
    """Endless, resumable stream of prompt batches from ``config.source``."""

    def __init__(self, config: PromptDataConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.skipped = SkipReport()
        self.epoch = 0
        self.index = 0
        if config.source == SYNTHETIC:
            self._table = None
            self._templated = uses_chat_template(tokenizer, config)
            self.seed = config.synthetic.seed
        else:
            self._table, self.skipped = load_prompt_files(config, tokenizer)
            self.seed = config.seed
            self._order = epoch_order(len(self._table.texts), 0, self.seed, config.shuffle)

    @property
    def num_prompts(self) -> int | None:
        """Distinct prompts of a file source (after skipping); None for the endless synthetic task."""
        return None if self._table is None else len(self._table.texts)

    def state_dict(self) -> dict[str, int]:
        """The position: the next batch starts at ``index`` of ``epoch``'s order (synthetic: problem ``index``)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a position from ``state_dict()``; the seed must be this stream's."""
        if set(state) != {"epoch", "index", "seed"}:
            raise ValueError(f"prompt stream state needs keys epoch, index, seed; got {sorted(state)}")
        if state["seed"] != self.seed:
            raise ValueError(f"prompt stream state has seed {state['seed']} but the config gives {self.seed}")
        size = self.num_prompts
        if state["epoch"] < 0 or state["index"] < 0 or (size is not None and state["index"] > size):
            raise ValueError(f"prompt stream state {state} is out of range for {size} prompts")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        if self._table is not None:
            self._order = epoch_order(len(self._table.texts), self.epoch, self.seed, self.config.shuffle)

    def next_batch(self, n: int) -> list[PromptSample]:
        """The next ``n`` prompts; a file source rolls over into the next epoch's order mid-batch if needed."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        return [self._next_synthetic() if self._table is None else self._next_row() for _ in range(n)]

    def _next_row(self) -> PromptSample:
        table = self._table
        if self.index >= len(table.texts):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = epoch_order(len(table.texts), self.epoch, self.seed, self.config.shuffle)
        row = int(self._order[self.index])
        self.index += 1
        return PromptSample(table.texts[row], table.ids[row].tolist(), table.answers[row], table.sources[row])

    def _next_synthetic(self) -> PromptSample:
        i = self.index
        (problem,) = training_problems(self.config.synthetic, 1, stream=i)
        messages = [{"role": "user", "content": problem.prompt}]
        text = render_prompt(messages, self.tokenizer, self.config, self._templated)
        (ids,) = tokenize([text], self.tokenizer, self._templated)
        if len(ids) > self.config.max_prompt_tokens:
            raise DatasetError(f"synthetic:{i}: prompt has {len(ids)} tokens > max_prompt_tokens="
                               f"{self.config.max_prompt_tokens}; raise it or lower synthetic.max_digits")
        self.index += 1
        return PromptSample(text, list(ids), problem.answer, f"synthetic:{i}")
