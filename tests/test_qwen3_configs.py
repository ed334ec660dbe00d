"""configs/qwen3-30b-a3b/*.yaml: every one loads and validates, its parallel sizes add up (EP divides the 128
experts, TP the heads, learner + server GPUs = nodes x 8), it matches its generator, and layouts that cannot work
fail naming the key; the run-config fields they need (parallel.world_size, launch.nodes / gpus_per_node) are
validated; ``qarl plan --config`` plans them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_qarl import cli
from megatron_qarl.errors import ConfigError
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.preflight.rules import load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs" / "qwen3-30b-a3b").glob("*.yaml"))
SCHEMES = ("bf16", "w8a8_fp8", "w8a8_int8", "w4a16")


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def test_every_scheme_algo_and_cluster_has_a_config():
    names = {p.stem for p in CONFIGS}
    assert names == {f"{s}_{a}_{n}x8" for s in SCHEMES for a in ("tbpo", "grpo") for n in (2, 4)}


def test_configs_match_their_generator():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "scripts/make_qwen3_30b_configs.py", "--check"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_validates_and_its_layout_adds_up(path):
    cfg = load_config(path)
    scheme, algo, cluster = path.stem.rsplit("_", 2)
    arch = Qwen3MoeArch.from_model_dir(cfg.model.path)
    assert (arch.num_experts, arch.num_attention_heads, arch.num_key_value_heads) == (128, 32, 4)
    p, r, la = cfg.parallel, cfg.rollout, cfg.launch
    assert cfg.quant.scheme == scheme
    assert cfg.algo.loss.mode == {"tbpo": "tbpo", "grpo": "token_ppo"}[algo]
    assert (p.tp, p.sp) == (4, True) and arch.num_experts % p.ep == 0 and arch.num_key_value_heads % p.tp == 0
    assert cfg.world_size % p.ep == 0 and cfg.world_size % p.tp == 0
    assert la.nodes == int(cluster[0]) and la.gpus_per_node == 8 and la.gpus_per_learner_rank == 1
    assert cfg.world_size + r.servers * r.gpus_per_server == la.nodes * la.gpus_per_node
    assert cfg.world_size % la.gpus_per_node == 0  # the learner owns whole nodes, the servers the others
    assert r.backend == "sglang" and la.gpus_per_node % r.gpus_per_server == 0
    # the public recipe's shapes
    assert (cfg.train.prompts_per_step, r.sampling.n_samples, r.sampling.max_new_tokens) == (32, 8, 8192)
    assert cfg.data.source.endswith(".parquet") and cfg.data.answer_key == "reward_model.ground_truth"
    ev = cfg.train.eval
    assert ev.data is not None and "aime" in ev.data.source and ev.sampled_n >= 16 and ev.max_new_tokens == 8192
    assert (la.ray_address, la.master_addr, la.server_host) == ("auto", "auto", "0.0.0.0")
    # memory: one full-length sequence per micro-batch, Adam sharded, no recompute (issue 55: the attention, TE's or
    # torch's fused one, keeps no s^2 scores); the 8-GPU learners of the 2 x 8 runs offload Adam to the host so that
    # they fit 80 GB GPUs
    le = cfg.learner
    assert (le.micro_batch_size, le.distributed_optimizer, le.recompute) == (1, True, "none")
    assert le.optimizer_cpu_offload == (cluster == "2x8") and le.optimizer_offload_fraction == 1.0


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_fits_80gb_gpus_with_either_attention_and_its_header_says_where_else(path):
    """As configured, each run fits H100 80GB GPUs whether the learner gets the TE spec's flash attention or the
    local spec's sdpa one (and the local spec's unfused one with selective recompute, which it needs: without it its
    s^2 scores do not fit); without optimizer offload the 2 x 8 learners need 141 GB GPUs (H200), the 4 x 8 ones do
    not. The header repeats what the plan says."""
    from megatron_qarl.plan.layouts import H100_GIB, H200_GIB, PlanOptions, config_plan

    cfg = load_config(path)
    for attention, recompute in (("flash", None), ("sdpa", None), ("unfused", "selective")):
        opts = {"attention": attention, "recompute": recompute}
        assert config_plan(cfg, PlanOptions(**opts), alternatives=False)["fits"], attention
        off = {gib: config_plan(cfg, PlanOptions(gpu_gib=gib, optimizer_cpu_offload=False, **opts),
                                alternatives=False)["fits"] for gib in (H100_GIB, H200_GIB)}
        assert off == {H100_GIB: path.stem.endswith("4x8"), H200_GIB: True}, attention
    assert not config_plan(cfg, PlanOptions(attention="unfused"), alternatives=False)["fits"]  # recompute none
    header = path.read_text().split("\nmodel:")[0]
    off_line = next(line for line in header.splitlines() if "offload off" in line)
    assert off_line.endswith("fits 80 GB and 141 GB GPUs" if path.stem.endswith("4x8") else "fits 141 GB GPUs")


def test_ep_not_dividing_the_experts_fails_naming_the_key():
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 3 does not divide the model's num_experts \(128"):
        load_config(CONFIGS[0], ["parallel.ep=3", "parallel.world_size=12"])
    with pytest.raises(ConfigError, match=r"^parallel\.tp: 8 does not divide the model's num_key_value_heads \(4"):
        load_config(CONFIGS[0], ["parallel.tp=8"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.world_size=12"], r"^parallel\.world_size: 12 is not a multiple of lcm\(tp=4, ep=8\) = 8"),
    (["rollout.servers=3"], r"^launch\.nodes: 2 nodes x 8 GPUs = 16, but the learner uses 8 .* servers 6"),
    (["launch.nodes=4"], r"^launch\.nodes: 4 nodes x 8 GPUs = 32"),
    (["rollout.gpus_per_server=3", "rollout.servers=2"], r"^rollout\.gpus_per_server: 3 does not divide"),
    (["launch.gpus_per_learner_rank=2"], r"^launch\.gpus_per_learner_rank: must be 1 on GPU nodes"),
    (["train.prompts_per_step=3", "rollout.sampling.n_samples=1"],
     r"^train\.prompts_per_step: 3 prompts x 1 samples = 3 responses do not split over the learner's 2 data-par"),
])
def test_bad_cluster_layouts_fail_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs/qwen3-30b-a3b/bf16_tbpo_2x8.yaml", overrides)


def test_sglang_server_width_must_suit_the_quantized_experts():
    # W4A16 with SGLang --tp-size 4 splits each expert's 768 columns into 192: not whole groups of 128
    with pytest.raises(ConfigError, match=r"^rollout\.gpus_per_server: SGLang cannot serve .* --tp-size 4 .*: "
                                          r".*768/4 is not a multiple of the w4a16 group"):
        load_config(REPO / "configs/qwen3-30b-a3b/w4a16_tbpo_2x8.yaml",
                    ["rollout.servers=2", "rollout.gpus_per_server=4"])


@pytest.mark.parametrize(("config", "overrides", "message"), [
    # SGLang's weight updates assert dp_size == 1: data parallelism is more servers
    ("w4a16_tbpo_4x8", ["rollout.dp_size=2"], r"^rollout\.dp_size: 2: SGLang's weight updates assert dp_size == 1"),
    # block-FP8 MoE needs tp % ep == 0
    ("w8a8_fp8_tbpo_4x8", ["rollout.ep_size=3"], r"^rollout\.ep_size: 3 must divide .*block-FP8 MoE needs tp % ep"),
    ("bf16_tbpo_4x8", ["rollout.ep_size=4"], r"^rollout\.ep_size: 4 must divide rollout\.gpus_per_server \(2"),
])
def test_sglang_servers_that_cannot_take_updates_are_refused(config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / f"configs/qwen3-30b-a3b/{config}.yaml", overrides)


def test_training_temperature_must_be_positive():
    with pytest.raises(ConfigError, match=r"^rollout\.sampling\.temperature: 0\.0 must be > 0 to train"):
        load_config(REPO / "configs/cpu_default.yaml", ["rollout.sampling.temperature=0"])


def test_cpu_config_has_no_gpu_accounting_and_world_size_defaults_to_lcm():
    cfg = load_config(REPO / "configs/cpu_default.yaml")
    assert (cfg.launch.nodes, cfg.launch.gpus_per_node, cfg.parallel.world_size, cfg.world_size) == (1, 0, None, 1)
    cfg = load_config(REPO / "configs/cpu_default.yaml", ["parallel.tp=2", "parallel.ep=2", "parallel.world_size=4"])
    assert cfg.world_size == 4


def test_plan_config_reports_both_parts_and_the_published_weights(capsys):
    assert cli.main(["plan", "--config", str(REPO / "configs/qwen3-30b-a3b/w4a16_tbpo_4x8.yaml"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    ckpt = plan["rollout_checkpoint_gib"]
    assert abs(ckpt["bf16"] - 56.88) / 56.88 < 0.02 and abs(ckpt["w4a16"] - 16.89) / 16.89 < 0.02
    le, ro = plan["learner"], plan["rollout"]
    assert (le["gpus"], le["tp"], le["ep"], le["dp"], le["edp"], le["sp"]) == (16, 4, 16, 4, 1, True)
    assert plan["learner_options"] == {
        "distributed_optimizer": True, "offload_fraction": 0.0, "recompute": "none", "recompute_num_layers": 1,
        "attention": "flash", "attention_why": "model.impl=auto on GPUs: the TE spec, assuming transformer_engine "
                                               "is installed there"}
    assert (le["micro_batch_sequences"], le["micro_batch_tokens"], le["optimizer_host_gib_per_rank"]) == (1, 9216, 0)
    for key in ("weights_gib", "gradients_gib", "optimizer_gib", "activations_gib", "qat_cache_gib"):
        assert le[key] > 0
    assert le["total_gib"] == pytest.approx(sum(le[k] for k in ("weights_gib", "gradients_gib", "optimizer_gib",
                                                                 "activations_gib", "qat_cache_gib")), abs=0.05)
    assert (ro["servers"], ro["gpus_per_server"], ro["seqs_per_server"]) == (16, 1, 16)
    assert ro["weights_gib"] == ckpt["w4a16"] and ro["kv_pool_gib"] > 0
    assert plan["cluster"] == {"nodes": 4, "gpus_per_node": 8, "gpus_used": 32}
    assert plan["fits"] and {a["placement"] for a in plan["alternatives"]} >= {"colocated", "split 2+2"}


def test_plan_config_text_says_whether_it_fits(capsys):
    path = str(REPO / "configs/qwen3-30b-a3b/bf16_tbpo_2x8.yaml")
    assert cli.main(["plan", "--config", path]) == 0
    text = capsys.readouterr().out
    assert "rollout checkpoint: bf16 56.87 GiB" in text
    assert "learner: 8 ranks, tp4 (sequence parallel on) ep8" in text
    assert ("  settings: distributed optimizer on, optimizer CPU offload of 100% of its shard, recompute none, "
            "attention flash") in text
    assert ("  micro-batch: 1 sequence x 9216 tokens = 9216 tokens per forward/backward (learner.micro_batch_size); "
            "a data-parallel rank's 128 sequences in 128 micro-batches") in text
    assert "  activation memory (train step): 17.11 GiB per GPU" in text
    assert "peak phase train_step: weights 7.49 + gradients 14.97 + activations 17.11 = 39.56 GiB" in text
    assert "phases (GiB per GPU): logprob_forward" in text and "fixed costs (GiB, plan/fixed_costs.py)" in text
    assert "weight sync: 56.87 GiB per sync" in text
    assert "host memory of the offloaded optimizer: 56.94 GiB per rank, 455.52 GiB per learner node" in text
    assert "rollout: 4 servers x 2 GPU (SGLang --tp-size 2)" in text and "=> FITS on 79.65 GiB GPUs" in text
    assert "layouts of 2 x 8 GPUs that fit" in text and "split 1+1: learner on 8, rollout on 8" in text
    # without offload the 8-GPU learner needs an H200 (launch.gpu_gib or --gpu-gib: the GPU it gets)
    assert cli.main(["plan", "--config", path, "learner.optimizer_cpu_offload=false"]) == 0
    assert "optimizer 42.71 + activations 17.11" in (text := capsys.readouterr().out) and "-> DOES NOT FIT" in text
    assert "margin -" in text
    assert cli.main(["plan", "--config", path, "learner.optimizer_cpu_offload=false", "launch.gpu_gib=140.4"]) == 0
    assert "=> FITS on 140.4 GiB GPUs" in capsys.readouterr().out
    assert cli.main(["plan", "--config", path, "--no-optimizer-cpu-offload", "--gpu-gib", "140"]) == 0
    assert "=> FITS on 140.0 GiB GPUs" in capsys.readouterr().out
    assert cli.main(["plan", "--config", path, "--attention", "unfused", "--recompute", "none"]) == 0
    assert "attention unfused (--attention)" in (text := capsys.readouterr().out) and "DOES NOT FIT" in text
    assert cli.main(["plan", "--config", path, "parallel.ep=3"]) == 2
    assert "parallel.ep: 3 does not divide" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "configs/models/qwen3-30b-a3b", "parallel.ep=3"]) == 2
    assert "need --config" in capsys.readouterr().err


def test_plan_config_follows_the_runs_learner_micro_batches(capsys):
    """The activations planned are those of the micro-batch the learner will run (learner.micro_batch_size)."""
    path = str(REPO / "configs/qwen3-30b-a3b/w4a16_tbpo_4x8.yaml")
    plans = {}
    for size in (1, 4):
        assert cli.main(["plan", "--config", path, f"learner.micro_batch_size={size}", "--json"]) == 0
        plans[size] = json.loads(capsys.readouterr().out)["learner"]
    assert (plans[1]["micro_batch_sequences"], plans[1]["micro_batch_tokens"]) == (1, 1024 + 8192)
    assert (plans[4]["micro_batch_sequences"], plans[4]["micro_batch_tokens"]) == (4, 4 * (1024 + 8192))
    assert plans[4]["activations_gib"] > 3 * plans[1]["activations_gib"]
    assert cli.main(["plan", "--config", path, "learner.micro_batch_size=null"]) == 0  # the whole share at once
    assert "64 sequences x 9216 tokens = 589824 tokens per forward/backward" in capsys.readouterr().out


def test_train_refuses_a_gpu_config_that_does_not_fit_before_starting_anything(tmp_path, capsys):
    """The acceptance: a 30B config edited to micro-batches of 32 sequences is refused by qarl train with the
    plan's figures, before any output is written or any process starts (CPU-only here: the learner's attention is
    the local spec's, as model.impl=auto resolves without transformer_engine)."""
    from megatron_qarl.plan.layouts import PlanOptions, config_plan
    from megatron_qarl.plan.render import learner_memory_line

    path = REPO / "configs/qwen3-30b-a3b/w4a16_tbpo_2x8.yaml"
    out = tmp_path / "run"
    overrides = ["learner.micro_batch_size=32", f"train.output_dir={out}"]
    assert cli.main(["train", "--config", str(path), *overrides]) == 2
    err = capsys.readouterr().err
    plan = config_plan(load_config(path, overrides), PlanOptions(te_available=False), alternatives=False)
    le = plan["learner"]
    assert f"{path}: does not fit 79.65 GiB GPUs (qarl plan --config {path} --attention sdpa)" in err
    assert f"the learner (tp4/ep8 on 8 GPUs) needs {learner_memory_line(le, plan)}" in err
    assert le["step"]["peak_phase"] == "train_step" and le["step"]["margin_gib"] < 0
    assert "micro-batch: 32 sequences x 9216 tokens = 294912 tokens per forward/backward" in err
    assert "attention sdpa (model.impl=auto without transformer_engine" in err
    assert le["activations_gib"] > 500 and not out.exists()


def test_train_memory_check_passes_configs_that_fit_and_skips_cpu_runs(tmp_path):
    from megatron_qarl.errors import UserError
    from megatron_qarl.train.cli import check_memory

    for path in CONFIGS:
        check_memory(load_config(path), str(path))  # every config as committed fits (here: the local spec)
    big = ["learner.micro_batch_size=32"]
    with pytest.raises(UserError, match=r"does not fit 140\.4 GiB GPUs"):  # launch.gpu_gib: the GPU it gets
        check_memory(load_config(CONFIGS[0], [*big, "launch.gpu_gib=140.4"]))
    check_memory(load_config(CONFIGS[0], [*big, "launch.memory_check=false"]))  # told to start anyway
    check_memory(load_config(REPO / "configs/cpu_default.yaml", ["learner.micro_batch_size=1000"]))  # CPU learner


QWEN3_235B_8X8 = ["model.path=configs/models/qwen3-235b-a22b", "launch.nodes=8", "parallel.world_size=32",
                  "parallel.ep=32", "rollout.servers=8", "rollout.gpus_per_server=4",
                  "learner.optimizer_cpu_offload=true"]  # W4A16 TBPO on 8 x 8 H100: learner 4 nodes, rollout 4


def test_qwen3_235b_w4a16_layout_on_8x8_h100_fits_with_full_recompute_and_train_refuses_selective(tmp_path, capsys):
    """Qwen3-235B-A22B (configs/models/qwen3-235b-a22b, the public model card's numbers): learner tp4/ep32 on 32
    H100s with optimizer CPU offload and full recompute fits (TE spec); with selective recompute qarl train
    refuses it with the plan's figures, before anything starts."""
    from megatron_qarl.plan.layouts import PlanOptions, config_plan
    from megatron_qarl.plan.render import learner_memory_line

    path = REPO / "configs/qwen3-30b-a3b/w4a16_tbpo_4x8.yaml"
    fits = config_plan(load_config(path, [*QWEN3_235B_8X8, "learner.recompute=full"]), PlanOptions(te_available=True),
                       alternatives=False)
    assert fits["fits"] and fits["learner"]["step"]["margin_gib"] > 0 and fits["rollout"]["tp"] == 4
    out = tmp_path / "run"
    overrides = [*QWEN3_235B_8X8, "learner.recompute=selective", f"train.output_dir={out}"]
    assert cli.main(["train", "--config", str(path), *overrides]) == 2
    err = capsys.readouterr().err
    plan = config_plan(load_config(path, overrides), PlanOptions(te_available=False), alternatives=False)
    assert f"the learner (tp4/ep32 on 32 GPUs) needs {learner_memory_line(plan['learner'], plan)}" in err
    assert not out.exists()
