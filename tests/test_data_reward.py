"""Rewards: math-verify equivalence on the boxed answer, timeouts that never hang, worker replacement."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import ValidationError

from megatron_qarl.data.math_task import extract_boxed
from megatron_qarl.data.reward import RewardConfig, RewardScorer, judge, verify_boxed

# sympy evaluates this tower for far longer than any timeout here (minutes), in interruptible Python code
PATHOLOGICAL = "\\boxed{9^{9^{9}}}"


def _hang_or_crash(boxed: str, ground_truth: str) -> bool:
    """Test verifier run inside the workers: "hang" blocks the timer signal and sleeps (like a C-level hang
    that no alarm can interrupt); "crash" kills the worker; anything else is an exact comparison."""
    if boxed == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(120)
    if boxed == "crash":
        os._exit(3)
    return boxed == ground_truth


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(RewardConfig(kind="math_verify", timeout_s=2.0, kill_grace_s=1.0, workers=2)) as s:
        yield s


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("so the answer is \\boxed{34}", "34", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{936.0}", "936", 1.0),
        ("\\boxed{936}", "936.0", 1.0),
        ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0),
        ("first \\boxed{3}, finally \\boxed{34}", "34", 1.0),
        ("\\boxed{34}, no wait: \\boxed{35}", "34", 0.0),
        ("\\boxed{35}", "34", 0.0),
        ("the answer is 34", "34", 0.0),
        ("\\boxed{}", "34", 0.0),
    ],
)
def test_the_workers_verdict_in_process(response, truth, expected):
    """What a RewardScorer worker decides (judge(verify_boxed, ...)) on the last boxed answer (extract_boxed)."""
    boxed = extract_boxed(response)
    verdict = None if boxed is None else judge(verify_boxed, boxed, truth, 5.0)
    assert (1.0 if verdict == "correct" else 0.0) == expected


def test_the_workers_verdict_times_out_in_process():
    start = time.monotonic()
    assert judge(verify_boxed, extract_boxed(PATHOLOGICAL), "34", 0.5) == "timeout"
    assert time.monotonic() - start < 5.0
    assert verify_boxed("12", "12")  # sympy state still usable after the interruption


def test_judge_refuses_other_threads():
    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(RuntimeError, match="main thread"):
            pool.submit(judge, verify_boxed, "1", "1", 1.0).result()


def test_scorer_rewards_and_counters(scorer):
    responses = ["\\boxed{34}", "so \\boxed{0.5}", "\\boxed{936.0}", "no box here", "\\boxed{35}", "\\boxed{x+1}"]
    answers = ["34", "\\frac{1}{2}", "936", "1", "34", "1+x"]
    rewards, stats = scorer.score(responses, answers)
    assert rewards == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert stats == {"timeouts": 0, "no_answer": 1, "errors": 0, "workers_replaced": 0}


def test_scorer_pathological_answer_times_out_and_scorer_keeps_working(scorer):
    before = scorer.totals["timeouts"]
    start = time.monotonic()
    rewards, stats = scorer.score([PATHOLOGICAL, "\\boxed{7}"], ["34", "7"])
    elapsed = time.monotonic() - start
    assert rewards == [0.0, 1.0]
    assert stats["timeouts"] == 1 and stats["errors"] == 0
    assert scorer.totals["timeouts"] == before + 1
    assert elapsed < 2.0 + 1.0 + 3.0  # timeout_s + kill_grace_s + slack on a busy machine
    assert scorer.score(["\\boxed{12}"], ["12"])[0] == [1.0]


def test_scorer_from_threads(scorer):
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(scorer.score, [f"\\boxed{{{k}}}", "\\boxed{0}"], [str(k), "1"]) for k in range(3)]
        results = [f.result() for f in futures]
    assert [r[0] for r in results] == [[1.0, 0.0]] * 3


def test_scorer_kills_and_replaces_a_worker_that_ignores_the_timer():
    cfg = RewardConfig(timeout_s=0.3, kill_grace_s=0.3, workers=1)
    scorer = RewardScorer(cfg, verify_fn=_hang_or_crash)
    try:
        assert scorer.score(["\\boxed{5}"], ["5"])[0] == [1.0]  # worker up
        (stuck,) = scorer.worker_pids()
        start = time.monotonic()
        rewards, stats = scorer.score(["\\boxed{hang}", "\\boxed{7}"], ["hang", "7"])
        assert time.monotonic() - start < 15.0  # 0.6 s deadline, then a fresh worker must start (imports sympy)
        assert rewards == [0.0, 1.0]
        assert stats == {"timeouts": 1, "no_answer": 0, "errors": 0, "workers_replaced": 1}
        assert not _is_running(stuck)
        assert scorer.worker_pids() != [stuck]

        rewards, stats = scorer.score(["\\boxed{crash}", "\\boxed{8}"], ["crash", "8"])
        assert rewards == [0.0, 1.0]
        assert stats["errors"] == 1 and stats["workers_replaced"] == 1
        assert scorer.totals == {"timeouts": 1, "no_answer": 0, "errors": 1, "workers_replaced": 2}

        (idle,) = scorer.worker_pids()  # a worker that dies between calls is replaced and nothing is lost
        os.kill(idle, signal.SIGKILL)
        os.waitpid(idle, 0)
        rewards, stats = scorer.score(["\\boxed{9}"], ["9"])
        assert rewards == [1.0] and stats["workers_replaced"] == 1 and scorer.worker_pids() != [idle]
    finally:
        pids = scorer.worker_pids()
        scorer.close()
    assert pids and not any(_is_running(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(["\\boxed{1}"], ["1"])


def test_exact_kind_runs_in_process_with_custom_values():
    scorer = RewardScorer(RewardConfig(kind="exact", correct_reward=2.0, incorrect_reward=-1.0))
    assert scorer.worker_pids() == []
    rewards, stats = scorer.score(["\\boxed{936}", "\\boxed{0.5}", "936"], ["936", "\\frac{1}{2}", "936"])
    assert rewards == [2.0, -1.0, -1.0]
    assert stats["no_answer"] == 1
    scorer.close()


def test_score_checks_lengths(scorer):
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        scorer.score(["a", "b"], ["a"])


def test_config_validation():
    with pytest.raises(ValidationError, match="correct_reward"):
        RewardConfig(correct_reward=0.0, incorrect_reward=0.0)
    with pytest.raises(ValidationError, match="extra"):
        RewardConfig(timeout=3)
    with pytest.raises(ValidationError):
        RewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match="module-level"):
        RewardScorer(RewardConfig(kind="exact"), verify_fn=lambda b, t: True)



def test_a_worker_that_fails_at_start_up_is_reported_with_its_own_exit_code(monkeypatch):
    """Issue 53 item 5: a worker whose verify function cannot be imported exits 1; the scorer, seeing its socket
    close, sent SIGTERM before it waited (``reap``), so the error said code -15. Now it waits for the exit first."""
    from megatron_qarl.data import reward

    monkeypatch.setattr(reward, "_function_spec", lambda fn: "no_such_module_of_issue_53:verify")
    scorer = RewardScorer(RewardConfig(workers=1))
    try:
        with pytest.raises(RuntimeError, match=r"reward worker exited during start-up \(code 1\)"):
            scorer.score(["\\boxed{1}"], ["1"])
    finally:
        scorer.close()
