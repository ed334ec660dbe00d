"""Files in the layout DAPO-Math-17k and AIME 2024 are published in (the parquet files of BytedTsinghua-SIA's Hugging
Face datasets, docs/data.md), written by the tests: no download here."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# the published rows' instruction (DAPO-Math-17k and AIME 2024 on Hugging Face, BytedTsinghua-SIA)
ASK = ("Solve the following math problem step by step. The last line of your response should be of the form Answer: "
       "$Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\nRemember to put your answer on "
       'its own line after "Answer:".')


def published_row(index: int, problem: str, answer: str) -> dict:
    """One row as the published parquet files hold it."""
    return {"data_source": "math_dapo", "prompt": [{"content": ASK.format(problem), "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"uuid-{index}"}}


def write_published(path: Path, problems: list[tuple[str, str]], repeats: int, extra: list[dict] = ()) -> Path:
    """The problems repeated ``repeats`` times, block after block, as the published files are, then ``extra``."""
    rows = [published_row(r * 100 + i, p, a) for r in range(repeats) for i, (p, a) in enumerate(problems)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows + list(extra)), path)
    return path


def write_downloads(root: Path) -> Path:
    """A local copy of both datasets as `hf download --local-dir` leaves them (data/<name>.parquet)."""
    train = [("Q: 12+34= A:", "46"), ("Q: 56+7= A:", "63"), ("Q: 9-4= A:", "5")]
    write_published(root / "DAPO-Math-17k" / "data" / "dapo-math-17k.parquet", train, repeats=3, extra=[
        published_row(900, "Q: 12+34= A:", "47"),  # the same prompt with another answer
        published_row(901, "Q: 2*2= A:", "@@"),  # an answer math-verify keeps as text only
    ])
    write_published(root / "AIME-2024" / "data" / "aime-2024.parquet", [("Q: 21+21= A:", "42"), ("Q: 3*5= A:", "15")],
                    repeats=2)
    return root
