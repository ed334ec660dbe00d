"""Rollout-server faults during `qarl train`, in process on the tiny model with real `qarl serve` servers, reward
workers and a Megatron learner: a server killed mid-rollout loses no prompt (re-sent to the other server, or to the
only one once restarted with the current weights), non-finite steps are skipped and counted, and a stop request
ends the run with a checkpoint. (A file of its own so that xdist runs it beside tests/test_train_e2e.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from test_train_e2e import CPU_DEFAULT, SMALL

from megatron_qarl.preflight.rules import load_config
from megatron_qarl.train.tracking import read_metrics

pytestmark = pytest.mark.e2e


def test_server_killed_mid_rollout_loses_no_prompt_and_nonfinite_steps_are_skipped(tmp_path, tiny_model_dir):
    """In process: two servers; server 1 gets SIGKILL while step 2's rollout is in flight. Step 2's loss is
    poisoned with NaN: the update is skipped and counted. Then three poisoned steps in a row end the run."""
    from transformers import AutoTokenizer

    from megatron_qarl.data.prompts import PromptStream
    from megatron_qarl.launch.local import LocalLearnerRanks, LocalServers
    from megatron_qarl.train.cli import rollout_model_dir
    from megatron_qarl.train.trainer import Trainer, TrainingAborted

    cfg = load_config(CPU_DEFAULT, [f"train.output_dir={tmp_path / 'run'}", *SMALL, "train.steps=3",
                                    "rollout.servers=2", "train.prompts_per_step=8", "train.inject_nonfinite_steps=[2]",
                                    "train.max_nonfinite_in_row=2", "train.checkpoint.every=0"])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    servers = LocalServers(cfg, rollout_model_dir(cfg))
    learners = LocalLearnerRanks(cfg)
    trainer = Trainer(cfg, learners, servers, tokenizer=tokenizer, progress=False,
                      stream=PromptStream(cfg.data, tokenizer))
    killed = {}
    generate = trainer.rollouts.generate

    def generate_and_kill(manager, prompts, seed_step, live):
        if seed_step == 2 and not killed:  # step 2's rollout: kill server 1 once requests are in flight
            pid = servers.pids()[1]

            def kill():
                time.sleep(0.3)
                killed["pid"] = pid
                os.kill(pid, signal.SIGKILL)

            threading.Thread(target=kill, daemon=True).start()
        return generate(manager, prompts, seed_step, live)

    trainer.rollouts.generate = generate_and_kill
    try:
        trainer.run()
        rows = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss/loss" in r}
        assert killed and servers.pids()[1] != killed["pid"]  # restarted after the step
        s2 = rows[2]
        assert s2["faults/server_failures"] >= 1 and s2["faults/resent_requests"] > 0
        assert s2["faults/prompts_lost"] == 0
        assert s2["loss/num_responses"] == 8 * 4  # every prompt's G samples trained on
        assert s2["loss/skipped"] == 1.0 and s2["faults/nonfinite_total"] == 1
        assert rows[3]["loss/skipped"] == 0.0 and rows[3]["faults/nonfinite_total"] == 1
        assert rows[3]["mismatch/mismatch_tok_abs_mean"] < 1e-4  # the restarted server got the weights
        print(f"\nserver kill: failures={s2['faults/server_failures']}, re-sent requests="
              f"{s2['faults/resent_requests']}, prompts lost={s2['faults/prompts_lost']}, "
              f"responses trained={s2['loss/num_responses']:.0f}")

        # several non-finite steps in a row end the run with a clear message
        trainer.cfg = cfg.model_copy(update={"train": cfg.train.model_copy(
            update={"steps": 6, "inject_nonfinite_steps": [4, 5, 6]})})
        with pytest.raises(TrainingAborted, match=r"step 5: 2 steps in a row had a non-finite loss"):
            trainer.run()
    finally:
        trainer.close()
        learners.close()
        servers.close()


def test_the_only_server_killed_mid_rollout_is_restarted_with_the_weights_and_a_stop_checkpoints(tmp_path):
    """One server: it is restarted during the rollout, gets the current weights, and the step completes. Then a
    stop request during step 3 ends the run after step 3 with a checkpoint of it (once)."""
    from transformers import AutoTokenizer

    from megatron_qarl.launch.local import LocalLearnerRanks, LocalServers
    from megatron_qarl.train.cli import rollout_model_dir
    from megatron_qarl.train.trainer import StopRequested, Trainer

    cfg = load_config(CPU_DEFAULT, [f"train.output_dir={tmp_path / 'run'}", *SMALL, "train.steps=2",
                                    "train.prompts_per_step=8", "train.checkpoint.every=0"])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    servers = LocalServers(cfg, rollout_model_dir(cfg))
    learners = LocalLearnerRanks(cfg)
    trainer = Trainer(cfg, learners, servers, tokenizer=tokenizer, progress=False)
    generate = trainer.rollouts.generate
    killed = []
    stop = threading.Event()

    def generate_and_kill(manager, prompts, seed_step, live):
        if seed_step == 2 and not killed:
            pid = servers.pids()[0]
            killed.append(pid)
            threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
        if seed_step == 3:  # a stop request (Slurm's USR1, a preemption's SIGTERM) during step 3
            stop.set()
        return generate(manager, prompts, seed_step, live)

    trainer.rollouts.generate = generate_and_kill
    try:
        trainer.run()
        s2 = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}[2]
        assert servers.pids()[0] != killed[0]
        assert s2["faults/server_failures"] == 1 and s2["faults/resent_requests"] > 0
        assert s2["faults/prompts_lost"] == 0 and s2["loss/num_responses"] == 8 * 4
        assert s2["mismatch/mismatch_tok_abs_mean"] < 1e-4  # re-sent requests ran on the current weights

        # a stop request ends the run at the next step boundary, with a checkpoint of the last finished step
        trainer.cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 5})})
        root = tmp_path / "run" / "checkpoints"
        with pytest.raises(StopRequested, match="after step 3"):
            trainer.run(stop)
        assert (root / "latest").read_text().strip() == "step_000003"
        saved = sorted(p.name for p in root.glob("step_*"))
        with pytest.raises(StopRequested, match="after step 3"):  # that step has its checkpoint: none again
            trainer.run(stop)
        assert sorted(p.name for p in root.glob("step_*")) == saved
    finally:
        trainer.close()
        learners.close()
        servers.close()
