"""`qarl train` end to end on the tiny model, with real rollout servers, reward workers and a Megatron learner:
resume after kill -9 is exact (also mid-overlap with train.async=one_step), a bad dataset line is named, and the
Ray launch trains on `qarl data prepare`'s files, answers SIGUSR2 with every stack, and its TensorBoard holds every
scalar we promise. Server faults mid-run: tests/test_train_faults.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from published_data import write_downloads

from megatron_qarl.train.tracking import read_metrics

pytestmark = pytest.mark.e2e

CPU_DEFAULT = "configs/cpu_default.yaml"
# small steps: 4 prompts x 4 samples, a short held-out set, a checkpoint every step
SMALL = ["launch.backend=local", "train.prompts_per_step=4", "rollout.sampling.n_samples=4", "train.eval.n=8",
         "train.eval.sampled_n=1", "train.eval.every=0", "rollout.max_batch_size=32", "train.checkpoint.every=1",
         "train.checkpoint.keep=2", "rollout.sampling.max_new_tokens=40",
         "rollout.dtype=float32",  # fp32 servers: reruns agree to ~1e-7 (bf16 rounding varies with the batch's make-up)
         "rollout.threads=1"]  # one torch thread per server: with the learner (and xdist's other worker) on 2 cores,
# more thrash in OpenMP's waits (a two-server test's rollouts took 50-104 s a step under the suite's load)
# what changes between two runs of the same config: wall-clock figures
# and the count of tokens whose two log-probs differ in any bit: with the default numerics the server's batched
# kernels round with the batch's make-up, so that count moves between runs (numerics: exact makes it 0)
VOLATILE = ("time/", "throughput/", "sync/seconds", "loss/mismatch_tok_differing", "mismatch/mismatch_tok_differing")


def _qarl_train(out: Path, extra: list[str], resume: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_qarl.cli", "train", "--config", CPU_DEFAULT, "--no-progress",
           *(["--resume"] if resume else []), f"train.output_dir={out}", *SMALL, *extra]
    log = open(out.parent / f"{out.name}.log", "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[1])


def _wait_for(ready, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 600) -> None:
    rc = proc.wait(timeout=timeout)
    assert rc == 0, (out.parent / f"{out.name}.log").read_text()[-4000:]


def _kill_9_after_checkpoint(proc: subprocess.Popen, out: Path, step: str, timeout: float = 600) -> None:
    """SIGKILL the run as soon as its checkpoints/latest names ``step``."""
    latest = out / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout
    while not (latest.is_file() and latest.read_text().strip() == step):
        assert proc.poll() is None, (out.parent / f"{out.name}.log").read_text()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def test_kill_9_then_resume_gives_the_uninterrupted_metrics(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    steps = ["train.steps=2"]
    ref = _qarl_train(full, steps)  # the uninterrupted run, beside the killed one (separate processes and ports)
    proc = _qarl_train(killed, steps)
    _kill_9_after_checkpoint(proc, killed, "step_000001")  # step 2 is lost or half done
    _finish(_qarl_train(killed, steps, resume=True), killed)
    _finish(ref, full)

    want = {r["step"]: r for r in read_metrics(full / "metrics.jsonl") if "loss/loss" in r}
    got = {r["step"]: r for r in read_metrics(killed / "metrics.jsonl") if "loss/loss" in r}
    assert sorted(got) == [1, 2]  # no duplicate of a step the crash interrupted
    for step in (1, 2):
        a, b = _stable(want[step]), _stable(got[step])
        assert a.keys() == b.keys()
        # the same samples: rewards and lengths are equal exactly
        for key in ("reward/mean", "reward/accuracy", "length/response_mean", "length/response_max", "loss/num_tokens"):
            assert a[key] == b[key], (step, key)
        # log-prob figures: the server's fp32 batched kernels round differently with the batch's make-up
        # (~1e-7 on a log-prob, seen between two uninterrupted runs too), so compare at 1e-5
        diff = {k: (a[k], b[k]) for k in a if not a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5)}
        assert not diff, f"step {step} differs after resume: {diff}"


def test_one_step_kill_9_mid_overlap_then_resume_loses_no_prompt(tmp_path):
    """train.async=one_step: kill -9 after step 2's checkpoint, while step 3's rollout (sampled during step 2) is
    in flight or waiting; --resume draws step 3's prompts again and regenerates them at the checkpoint's weights
    (the in-flight samples are not saved): every prompt is trained on once, none is skipped."""
    from megatron_qarl.learner import checkpoint as ckpt

    out = tmp_path / "async"
    steps = ["train.steps=3", "train.async=one_step", "train.eval.n=4", "train.learner_threads=1", "rollout.threads=1"]
    proc = _qarl_train(out, steps)
    _kill_9_after_checkpoint(proc, out, "step_000002")
    at_kill = ckpt.read_state(out / "checkpoints" / "step_000002")["trainer"]["data"]
    _finish(_qarl_train(out, steps, resume=True), out)

    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss/loss" in r}
    assert sorted(rows) == [1, 2, 3]
    # the checkpoint's data position is after steps 1-2's prompts only: step 3's, drawn for the rollout in flight,
    # were not counted as trained, and after the resume exactly those 4 were
    assert at_kill["index"] == 2 * 4
    assert ckpt.read_state(out / "checkpoints" / "step_000003")["trainer"]["data"]["index"] == 3 * 4
    assert rows[2]["staleness/token_frac_1"] == 1.0  # step 2 trained on step-1-era samples: one version behind
    assert rows[3]["staleness/token_frac_0"] == 1.0  # regenerated after the resume, at the checkpoint's weights
    assert all(r["loss/num_responses"] == 4 * 4 and r["async/regenerated"] == 0 for r in rows.values())
    assert all(r["mismatch_quant/mismatch_tok_abs_mean"] <= 1e-5 for r in rows.values())  # fp32 servers


def test_malformed_dataset_line_is_named_before_anything_starts(tmp_path):
    data = tmp_path / "prompts.jsonl"
    good = json.dumps({"prompt": "Q: 1+2= A:", "reward_model": {"ground_truth": "3"}})
    data.write_text(f"{good}\n{good}\n{{not json\n")
    res = subprocess.run([sys.executable, "-m", "megatron_qarl.cli", "train", "--config", CPU_DEFAULT,
                          f"data.source={data}", f"train.output_dir={tmp_path / 'out'}", "launch.backend=local"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert res.returncode == 2
    assert f"{data}:3" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "out" / "logs").exists()  # no server was started


TB_SCALARS = [
    "reward/mean", "reward/accuracy", "reward/timeouts", "eval/greedy_accuracy", "eval/sampled_accuracy",
    "length/response_mean", "length/response_max", "length/truncated_frac", "length/padded_frac", "length/loss_frac",
    "loss/loss", "loss/clip_frac", "loss/grad_norm", "loss/skipped",
    "mismatch/mismatch_tok_abs_mean", "mismatch/mismatch_tok_abs_p99", "mismatch/mismatch_tok_kl",
    "mismatch/mismatch_seq_kl", "mismatch/mismatch_seq_weight_mean",
    "error_tokens/err_repeat_rate", "error_tokens/err_low_prob_frac", "error_tokens/err_truncated_no_answer_rate",
    "throughput/tokens_per_s", "throughput/rollout_tokens_per_s",
    "time/rollout_s", "time/reward_s", "time/logp_s", "time/update_s", "time/sync_s", "time/step_s", "time/eval_s",
    "time/checkpoint_s", "sync/bytes", "sync/seconds", "sync/weight_version", "faults/nonfinite_total",
]


def test_ray_launch_trains_on_prepared_data_dumps_stacks_and_tensorboard_holds_every_scalar(tmp_path):
    """The default launcher (Ray: learner ranks and the server as actors in a placement group) with a
    TP2 x EP2 learner (2 ranks, sharded checkpoints), training 2 steps on what `qarl data prepare` made of files in the
    published DAPO-Math-17k / AIME 2024 layout (docs/data.md); SIGUSR2 mid-run prints every thread's stack of the
    trainer and of both learner ranks' actors into the trainer's log, and the run goes on (utils/stacks.py); then the
    event files are read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_qarl import cli

    write_downloads(tmp_path / "hf")
    assert cli.main(["data", "prepare", "--from", str(tmp_path / "hf"), "--to", str(tmp_path / "data")]) == 0
    out = tmp_path / "ray"
    # the servers' own environment (rollout.server_python): an interpreter that records its argv, then runs ours
    env = tmp_path / "server-env"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_text(f'#!/bin/bash\nprintf "%s\\n" "$0" "$@" > "{env}/argv.$$"\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    proc = _qarl_train(out, ["launch.backend=ray", "train.steps=2", "parallel.tp=2", "parallel.ep=2",
                             f"rollout.server_python={python}", f"data.source={tmp_path / 'data' / 'dapo-math-17k'}",
                             f"train.eval.data.source={tmp_path / 'data' / 'aime-2024'}",
                             "train.eval.max_new_tokens=24"])  # the tiny model's context: 128 tokens
    log = out.parent / f"{out.name}.log"
    _wait_for(lambda: (out / "metrics.jsonl").is_file(), proc, log)  # the first evaluation: the ranks are up
    proc.send_signal(signal.SIGUSR2)
    _wait_for(lambda: "stacks: learner rank 1" in log.read_text(), proc, log)
    _finish(proc, out)
    text = log.read_text()
    trainer = text[text.index("Current thread 0x"):text.index("stacks: learner rank 0")]
    assert "megatron_qarl/train/cli.py" in trainer and "megatron_qarl/cli.py" in trainer, text[-6000:]
    for rank in (0, 1):
        dump = text[text.index(f"stacks: learner rank {rank} (pid"):].split("stacks: learner rank", 2)[1]
        assert str(out / "logs" / f"learner_rank{rank}.stacks") in dump and "Current thread 0x" in dump, dump
        assert "ray/_private/worker.py" in dump, dump  # the actor's main loop (idle, or running a LearnerWorker call)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss/num_responses" in r]
    assert [r["loss/num_responses"] for r in rows] == [4 * 4, 4 * 4]  # trained on the prepared prompts
    runs = [p.read_text().splitlines() for p in env.glob("argv.*")]
    assert [str(python), "-m", "megatron_qarl.cli", "serve"] in [a[:4] for a in runs], runs  # the Ray server actor
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    have = set(acc.Tags()["scalars"])
    missing = [k for k in TB_SCALARS if k not in have]
    assert not missing, f"missing TensorBoard scalars: {missing}"
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
    assert [e.step for e in acc.Scalars("eval/greedy_accuracy")] == [0, 2]
    assert acc.Scalars("sync/bytes")[-1].value > 0
    assert (out / "plots.png").is_file() and (out / "summary.json").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
