"""The project's synthetic math task: multi-digit addition (and optionally subtraction) with worked steps.

A problem is a pair of n-digit operands and an operation. Its prompt and the supervised target are::

    prompt:  "Q: 347+589= A:"
    target:  " 7+9=16 4+8+1=13 3+5+1=9 \\boxed{936}"

The target works column by column from the right; a carry (or, for subtraction, a borrow) shows up as a
trailing "+1" (or "-1") in the next column, and a borrowing column writes its top digit with a leading 1
("12-7=5"). The final answer is the last ``\\boxed{...}`` of a response; the reward is exact match on it.

Held-out split: a problem is *reserved* when a stable hash of its prompt falls in bucket 0 of
``HELDOUT_BUCKETS``. Training streams never yield reserved problems, for any config or seed, and the held-out
split is a fixed seeded sample of reserved problems, so the two never overlap by construction.

Everything here is a pure function of its arguments (randomness comes from seeded ``random.Random``
instances, whose string seeding is stable across processes and PYTHONHASHSEED).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Operation = Literal["+", "-"]

# one problem in HELDOUT_BUCKETS is reserved for evaluation; changing this moves the held-out split
HELDOUT_BUCKETS = 10
# rejection-sampling attempts allowed per requested problem before the config is declared too narrow
_MAX_ATTEMPTS_PER_PROBLEM = 1000


class MathTaskConfig(BaseModel):
    """Difficulty knobs and seeds of the task. The defaults are the held-out evaluation distribution."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_digits: int = Field(3, ge=1, le=9, description="fewest digits per operand")
    max_digits: int = Field(3, ge=1, le=9, description="most digits per operand (both share a length)")
    operations: tuple[Operation, ...] = Field(("+",), min_length=1, description="operations drawn uniformly")
    show_steps: bool = Field(True, description="targets include the column-by-column work before the box")
    seed: int = Field(0, description="seed of the training stream")
    heldout_size: int = Field(200, ge=1, description="number of held-out problems")
    heldout_seed: int = Field(20261129, description="picks the held-out sample among reserved problems")

    @model_validator(mode="after")
    def _check(self) -> MathTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) > max_digits ({self.max_digits})")
        if len(set(self.operations)) != len(self.operations):
            raise ValueError(f"operations has duplicates: {self.operations}")
        return self


@dataclass(frozen=True)
class Problem:
    """One problem: operands, operation, and the texts derived from them."""

    a: int
    b: int
    op: Operation
    prompt: str
    target: str
    answer: str


def format_prompt(a: int, b: int, op: Operation) -> str:
    """Return the prompt text, e.g. ``"Q: 347+589= A:"``."""
    return f"Q: {a}{op}{b}= A:"


def _digits_from_right(x: int, width: int) -> list[int]:
    """Digits of ``x`` from least significant, zero-padded to ``width``."""
    return [(x // 10**i) % 10 for i in range(width)]


def addition_steps(a: int, b: int) -> list[str]:
    """Column-by-column work for ``a + b``: ``["7+9=16", "4+8+1=13", "3+5+1=9"]`` for 347+589."""
    width = max(len(str(a)), len(str(b)))
    steps, carry = [], 0
    for x, y in zip(_digits_from_right(a, width), _digits_from_right(b, width), strict=True):
        total = x + y + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
        carry = total // 10
    return steps


def subtraction_steps(a: int, b: int) -> list[str]:
    """Column-by-column work for ``a - b`` (``a >= b``): ``["12-7=5", "13-8-1=4", "5-1-1=3"]`` for 532-187."""
    if a < b:
        raise ValueError(f"subtraction needs a >= b, got {a}-{b}")
    width = len(str(a))
    steps, borrow = [], 0
    for x, y in zip(_digits_from_right(a, width), _digits_from_right(b, width), strict=True):
        top = x + 10 if x - borrow < y else x
        steps.append(f"{top}-{y}{'-1' if borrow else ''}={top - y - borrow}")
        borrow = 1 if top > x else 0
    return steps


def make_problem(a: int, b: int, op: Operation, show_steps: bool = True) -> Problem:
    """Build a problem with its prompt, target (leading space, no EOS) and ground-truth answer."""
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative, got {a}, {b}")
    if op == "+":
        answer, steps = a + b, addition_steps(a, b)
    elif op == "-":
        answer, steps = a - b, subtraction_steps(a, b)
    else:
        raise ValueError(f"unknown operation {op!r}")
    work = " ".join(steps) + " " if show_steps else ""
    target = f" {work}\\boxed{{{answer}}}"
    return Problem(a=a, b=b, op=op, prompt=format_prompt(a, b, op), target=target, answer=str(answer))


def is_reserved(prompt: str) -> bool:
    """Whether the problem with this prompt is on the held-out side of the split (stable hash bucket 0)."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % HELDOUT_BUCKETS == 0


def sample_problem(rng: random.Random, config: MathTaskConfig) -> Problem:
    """Draw one problem: a digit count, an operation, and two operands of that length (leading digit > 0)."""
    n = rng.randint(config.min_digits, config.max_digits)
    low = 0 if n == 1 else 10 ** (n - 1)
    op = rng.choice(config.operations)
    a, b = rng.randint(low, 10**n - 1), rng.randint(low, 10**n - 1)
    if op == "-" and a < b:
        a, b = b, a
    return make_problem(a, b, op, config.show_steps)


def _sample_distinct(rng: random.Random, config: MathTaskConfig, n: int, reserved: bool) -> list[Problem]:
    """Draw ``n`` distinct problems on one side of the split by rejection; raise if the space is too small."""
    seen: set[str] = set()
    problems: list[Problem] = []
    for _ in range(_MAX_ATTEMPTS_PER_PROBLEM * max(n, 1)):
        if len(problems) == n:
            return problems
        problem = sample_problem(rng, config)
        if problem.prompt in seen or is_reserved(problem.prompt) != reserved:
            continue
        seen.add(problem.prompt)
        problems.append(problem)
    if len(problems) == n:
        return problems
    side = "held-out" if reserved else "training"
    raise ValueError(f"could not draw {n} distinct {side} problems from {config!r}; widen the digit range")


def heldout_problems(config: MathTaskConfig | None = None, n: int | None = None) -> list[Problem]:
    """The fixed held-out split: the first ``n`` (default ``config.heldout_size``) of a seeded sample.

    Prefixes are stable: ``heldout_problems(c, 50)`` is the first 50 of ``heldout_problems(c, 200)``.
    Training problems (``training_problems``) never include any of these.
    """
    config = config or MathTaskConfig()
    n = config.heldout_size if n is None else n
    if not 0 <= n <= config.heldout_size:
        raise ValueError(f"n must be in [0, heldout_size={config.heldout_size}], got {n}")
    rng = random.Random(f"heldout:{config.heldout_seed}")
    return _sample_distinct(rng, config, config.heldout_size, reserved=True)[:n]


def training_problems(config: MathTaskConfig, n: int, stream: int = 0) -> list[Problem]:
    """``n`` distinct training problems (never held-out ones) from the seeded stream number ``stream``.

    Stream ``k`` depends only on ``(config, k)``, so e.g. ``stream=step`` gives each training step its own
    reproducible batch without replaying earlier ones.
    """
    rng = random.Random(f"train:{config.seed}:{stream}")
    return _sample_distinct(rng, config, n, reserved=False)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` with balanced braces, stripped; None if there is none.

    ``\\boxed{}`` gives ``""``; an unclosed last box is ignored in favour of an earlier closed one.
    """
    marker = "\\boxed{"
    pos = text.rfind(marker)
    while pos != -1:
        depth, start = 1, pos + len(marker)
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
        pos = text.rfind(marker, 0, pos)
    return None


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 if the last boxed answer of ``response`` equals ``answer`` (whitespace-stripped), else 0.0."""
    boxed = extract_boxed(response)
    return 1.0 if boxed is not None and boxed == answer.strip() else 0.0
