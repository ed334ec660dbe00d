"""The synthetic math task: formats, determinism, the held-out split, boxed extraction, difficulty knobs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from megatron_qarl.data.math_task import (
    MathTaskConfig,
    exact_match_reward,
    extract_boxed,
    heldout_problems,
    is_reserved,
    make_problem,
    training_problems,
)


def test_addition_format_matches_the_calibrated_one():
    p = make_problem(347, 589, "+")
    assert p.prompt == "Q: 347+589= A:"
    assert p.target == " 7+9=16 4+8+1=13 3+5+1=9 \\boxed{936}"
    assert p.answer == "936"


def test_final_carry_and_no_steps():
    assert make_problem(999, 1, "+").target.endswith("9+0+1=10 \\boxed{1000}")
    assert make_problem(12, 34, "+", show_steps=False).target == " \\boxed{46}"


def test_subtraction_format_borrows():
    p = make_problem(532, 187, "-")
    assert p.prompt == "Q: 532-187= A:"
    assert p.target == " 12-7=5 13-8-1=4 5-1-1=3 \\boxed{345}"
    assert make_problem(1000, 1, "-").answer == "999"
    with pytest.raises(ValueError):
        make_problem(1, 2, "-")


@pytest.mark.parametrize("seed", [0, 1])
def test_targets_are_correct_and_end_in_their_answer(seed):
    config = MathTaskConfig(min_digits=1, max_digits=5, operations=("+", "-"), seed=seed)
    for p in training_problems(config, 300):
        expected = p.a + p.b if p.op == "+" else p.a - p.b
        assert p.answer == str(expected)
        assert extract_boxed(p.target) == p.answer
        assert exact_match_reward(p.target, p.answer) == 1.0


def test_generation_is_deterministic_and_seeded():
    config = MathTaskConfig(min_digits=2, max_digits=4)
    assert training_problems(config, 50, stream=3) == training_problems(config, 50, stream=3)
    assert training_problems(config, 50, stream=3) != training_problems(config, 50, stream=4)
    other_seed = config.model_copy(update={"seed": 1})
    assert training_problems(config, 50) != training_problems(other_seed, 50)
    assert heldout_problems(config) == heldout_problems(config)


def test_heldout_split_is_fixed():
    """Pin the first held-out problems so an accidental change of the split fails loudly."""
    problems = heldout_problems()
    assert len(problems) == 200 and len({p.prompt for p in problems}) == 200
    assert all(p.op == "+" and 100 <= p.a <= 999 and 100 <= p.b <= 999 for p in problems)
    assert [p.prompt for p in problems[:3]] == [p.prompt for p in heldout_problems(n=3)]
    larger = heldout_problems(MathTaskConfig(heldout_size=300))
    assert [p.prompt for p in larger[:200]] == [p.prompt for p in problems]
    assert [p.prompt for p in problems[:3]] == PINNED_HELDOUT_PROMPTS


PINNED_HELDOUT_PROMPTS = ["Q: 997+468= A:", "Q: 905+615= A:", "Q: 689+716= A:"]


def test_heldout_never_overlaps_training():
    heldout = {p.prompt for p in heldout_problems()}
    assert all(is_reserved(prompt) for prompt in heldout)
    for config in (MathTaskConfig(), MathTaskConfig(min_digits=2, max_digits=4, seed=7)):
        for stream in range(20):
            batch = training_problems(config, 64, stream=stream)
            assert not any(is_reserved(p.prompt) for p in batch)
            assert heldout.isdisjoint(p.prompt for p in batch)


def test_about_one_in_ten_problems_is_reserved():
    prompts = [make_problem(a, b, "+").prompt for a in range(100, 140) for b in range(100, 200)]
    fraction = sum(map(is_reserved, prompts)) / len(prompts)
    assert 0.08 < fraction < 0.12


def test_difficulty_knobs():
    config = MathTaskConfig(min_digits=4, max_digits=5, operations=("-",))
    problems = training_problems(config, 200)
    assert {len(str(p.a)) for p in problems} == {4, 5}
    assert all(len(str(p.a)) == len(str(p.b)) and p.op == "-" and p.a >= p.b for p in problems)
    mixed = training_problems(MathTaskConfig(operations=("+", "-")), 200)
    assert {p.op for p in mixed} == {"+", "-"}
    one_digit = training_problems(MathTaskConfig(min_digits=1, max_digits=1), 20)
    assert all(0 <= p.a <= 9 and 0 <= p.b <= 9 for p in one_digit)


def test_too_narrow_a_space_is_an_error():
    # 1-digit addition has 100 problems, about 10 of them reserved
    with pytest.raises(ValueError, match="distinct held-out"):
        heldout_problems(MathTaskConfig(min_digits=1, max_digits=1))
    with pytest.raises(ValueError):
        heldout_problems(MathTaskConfig(), n=201)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_digits": 4, "max_digits": 3},
        {"min_digits": 0},
        {"operations": ()},
        {"operations": ("*",)},
        {"operations": ("+", "+")},
        {"heldout_size": 0},
        {"unknown_knob": 1},
    ],
)
def test_bad_configs_are_rejected(kwargs):
    with pytest.raises(ValidationError):
        MathTaskConfig(**kwargs)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{936}", "936"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{ 42 }", "42"),
        ("\\boxed{}", ""),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{7} and an unclosed \\boxed{8", "7"),
        ("\\boxed{8", None),
        ("no box here: 936", None),
        ("\\boxed 5", None),
        ("", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_exact_match_reward():
    assert exact_match_reward(" 7+9=16 \\boxed{936}", "936") == 1.0
    assert exact_match_reward("\\boxed{936} ", " 936 ") == 1.0
    assert exact_match_reward("\\boxed{0936}", "936") == 0.0
    assert exact_match_reward("\\boxed{}", "936") == 0.0
    assert exact_match_reward("936", "936") == 0.0
