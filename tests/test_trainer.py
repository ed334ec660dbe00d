"""The training loop's parts that need no servers: batch layout, checkpoint atomicity, the run config's
new sections, and the TensorBoard/JSONL tracker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_qarl.errors import ConfigError
from megatron_qarl.learner import checkpoint as ckpt
from megatron_qarl.preflight.rules import load_config
from megatron_qarl.rollout.manager import Sample
from megatron_qarl.train.tracking import Tracker, read_metrics
from megatron_qarl.train.trainer import build_batch

CPU_DEFAULT = "configs/cpu_default.yaml"


def _sample(prompt, response, logps):
    return Sample(0, 0, prompt, response, logps, "stop", "v1", "http://x")


def test_build_batch_aligns_sampler_logprobs_with_learner_positions():
    groups = [[_sample([1, 2, 3], [7, 8], [-0.1, -0.2]), _sample([1, 2], [9, 10, 11], [-1.0, -2.0, -3.0])]]
    batch, logp_sampler = build_batch(groups, pad_id=0)
    assert batch.tokens_BS.tolist() == [[1, 2, 3, 7, 8], [1, 2, 9, 10, 11]]
    # learner logp[t] scores token t+1: response tokens of row 0 sit at t = 2, 3; of row 1 at t = 1, 2, 3
    assert batch.loss_mask_BT.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert torch.allclose(logp_sampler, torch.tensor([[0, 0, -0.1, -0.2], [0, -1.0, -2.0, -3.0]]))


def test_checkpoint_commit_is_atomic_and_keeps_the_newest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        tmp = ckpt.tmp_dir(root, step)
        tmp.mkdir(parents=True)
        (tmp / "shard").write_text(str(step))
        ckpt.commit(root, step, {"trainer": {"step": step}}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert ckpt.latest(root).name == "step_000003"
    assert ckpt.read_state(ckpt.latest(root))["trainer"]["step"] == 3
    # a save that died half-way leaves a .tmp directory: latest still names the last complete one
    ckpt.tmp_dir(root, 4).mkdir()
    assert ckpt.latest(root).name == "step_000003"
    (root / "latest").write_text("step_000004.tmp\n")
    with pytest.raises(Exception, match="not a complete checkpoint"):
        ckpt.latest(root)


def test_run_config_sections_validate(tiny_model_dir):
    cfg = load_config(CPU_DEFAULT)
    assert cfg.rollout.sampling.n_samples >= 8 and cfg.train.prompts_per_step >= 16
    assert cfg.quant.scheme == "w4a16" and cfg.learner.aligned and cfg.algo.loss.mode == "tbpo"
    with pytest.raises(ConfigError, match=r"^launch.backend: 'local' runs one learner rank"):
        load_config(CPU_DEFAULT, ["launch.backend=local", "parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"^rollout.sampling.n_sample: unknown key"):
        load_config(CPU_DEFAULT, ["rollout.sampling.n_sample=4"])
    with pytest.raises(ConfigError, match=r"^train.steps: "):
        load_config(CPU_DEFAULT, ["train.steps=0"])
    with pytest.raises(ConfigError, match=r"^algo.loss: mismatch='tis_token' with mode='tbpo'"):
        load_config(CPU_DEFAULT, ["algo.loss.mismatch=tis_token"])


@pytest.mark.parametrize("path", ["configs/cpu_bf16_rollout.yaml", "configs/cpu_unaligned_tis.yaml",
                                  "configs/cpu_w8a8_fp8.yaml", "configs/cpu_w8a8_int8.yaml", "configs/cpu_grpo.yaml"])
def test_cpu_config_variants_load(path):
    """Each variant writes under the repository's runs/ (its relative output_dir is the config file's folder's)."""
    cfg = load_config(path)
    assert Path(cfg.train.output_dir) == Path(path).resolve().parents[1] / "runs" / Path(path).stem


def test_tracker_writes_tensorboard_and_truncates_on_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracker(tmp_path, total=3, progress=False)
    for step in (1, 2, 3):
        t.log(step, {"reward/mean": 0.1 * step, "time/step_s": 1.0})
    t.close()
    assert (tmp_path / "plots.png").is_file()
    t = Tracker(tmp_path, start_step=2, total=3, progress=False)  # resumed from step 2's checkpoint
    t.log(3, {"reward/mean": 0.9, "time/step_s": 1.0})
    t.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["reward/mean"] == 0.9
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    events = acc.Scalars("reward/mean")
    assert [(e.step, round(e.value, 3)) for e in events] == [(1, 0.1), (2, 0.2), (3, 0.9)]


def test_closing_ray_learner_ranks_logs_what_it_swallows(caplog):
    """Shutting down after a failure: a rank that cannot close is reported, and the run's own error stays on top."""
    from megatron_qarl.launch.ray_launcher import RayLearnerRanks

    class GoneActors(RayLearnerRanks):
        def on_every_rank(self, method, *args, timeout_s=None):
            raise RuntimeError(f"{method.__name__}: the actor died")

    with caplog.at_level("WARNING"):
        GoneActors([], timeout_s=1.0).close()
    assert "closing the learner ranks failed: RuntimeError: close: the actor died" in caplog.text


def _learner_worker(out: str):
    """Learner rank 0 of configs/cpu_default.yaml (one rank, its output dir ``out``), set up as the trainer's is."""
    from megatron_qarl.learner.worker import LearnerWorker

    worker = LearnerWorker(load_config(CPU_DEFAULT, [f"train.output_dir={out}"]), 0, 1)
    worker.setup(*worker.address())
    return worker


def _two_checkpoints(out: str) -> None:
    """Two checkpoints of configs/cpu_default.yaml's learner, as the trainer saves and commits them."""
    import dataclasses

    from megatron_qarl.train.trainer import TrainerState

    worker = _learner_worker(out)
    root, cfg = f"{out}/checkpoints", worker.cfg
    for step in (1, 2):
        worker.save(str(ckpt.tmp_dir(root, step)))
        data = {"epoch": 0, "index": step * cfg.train.prompts_per_step, "seed": cfg.data.synthetic.seed}
        ckpt.commit(root, step, {"trainer": dataclasses.asdict(TrainerState(step, step + 1, data))}, keep=3)


def _loads(out: str, path: str) -> int:
    """The weight version a fresh learner rank holds after loading the checkpoint ``path``."""
    worker = _learner_worker(out)
    worker.load(path, 7)
    return worker.weight_version


@pytest.fixture(scope="module")
def run_with_checkpoints(tmp_path_factory, tiny_model_dir):
    """A run folder whose checkpoints/ holds two real learner checkpoints (steps 1 and 2, one rank)."""
    from megatron_qarl.moe.parallelize import run_ranks

    out = tmp_path_factory.mktemp("run")
    run_ranks(1, _two_checkpoints, str(out))
    return out


@pytest.mark.parametrize("damage", ["truncated .distcp", "missing .distcp", "corrupt .metadata", "corrupt common.pt",
                                    "trainer_state.json cut short"])
def test_resume_from_a_corrupt_checkpoint_names_the_file_and_the_older_one(damage, run_with_checkpoints, tmp_path,
                                                                           capsys):
    """Issue 53 item 6: before, a run whose newest checkpoint had one ``.distcp`` truncated ended ``qarl train
    --resume`` in ``CheckpointException ... EOFError`` (exit 1) after starting the servers and the learner, naming
    neither the file nor the complete checkpoint beside it. Now the checkpoint is checked before anything starts:
    exit 2, the file, and the newest older checkpoint that checks out, which ``--resume`` then takes."""
    import shutil

    from megatron_qarl import cli

    out = tmp_path / "run"
    shutil.copytree(run_with_checkpoints, out)
    newest, older = out / "checkpoints" / "step_000002", out / "checkpoints" / "step_000001"
    bad = {"truncated .distcp": newest / "__0_0.distcp", "missing .distcp": newest / "__0_1.distcp",
           "corrupt .metadata": newest / ".metadata", "corrupt common.pt": newest / "common.pt",
           "trainer_state.json cut short": newest / ckpt.STATE_FILE}[damage]
    if damage == "missing .distcp":
        bad.unlink()
    else:
        with open(bad, "r+b") as f:
            f.truncate(bad.stat().st_size // 2)
    argv = ["train", "--config", CPU_DEFAULT, f"train.output_dir={out}", "launch.backend=local", "--no-preflight",
            "--resume"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{bad}:" in err and f"Checkpoint {newest} is incomplete or corrupt" in err, err
    assert f"the newest older checkpoint that checks out is {older}: continue from it with --resume {older}" in err
    assert not (out / "rollout_init").exists() and not (out / "logs").exists()  # nothing was started
    assert ckpt.resume_point(out / "checkpoints", str(older)) == older  # what --resume CHECKPOINT continues from
    with pytest.raises(Exception, match="no older checkpoint in .* checks out"):
        ckpt.resume_point(out / "checkpoints", str(older.with_name("step_000000")))
    if damage == "truncated .distcp":  # and the learner loads it
        from megatron_qarl.moe.parallelize import run_ranks

        assert run_ranks(1, _loads, str(out), str(older)) == [7]
