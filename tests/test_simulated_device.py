"""The learner's GPU code paths on a simulated CUDA device (megatron_qarl/gpu/simulated_device.py): the device's rules
(a CPU tensor mixed into device arithmetic fails, as on CUDA), then every learner check of scripts/gpu_smoke.sh run
by ``python -m megatron_qarl.gpu.smoke simulate`` (TP1/EP1, local spec, every scheme): the aligned forward, the sync
payload through a weight-update group that takes device tensors only, a train step, an R3 train step, the delta
encoder, a checkpoint save, and the simulated run equal to the CPU run bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_qarl.gpu import smoke as gpu_smoke
from megatron_qarl.gpu.simulated_device import SimTensor, simulated_cuda
from megatron_qarl.moe import megatron_cpu
from megatron_qarl.qat.config import SCHEMES

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.simulated_device,
              pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: gpu_smoke runs the real checks")]


def test_cuda_allocations_land_on_the_simulated_device():
    with simulated_cuda():
        made = [torch.empty(2, device="cuda"), torch.zeros(2, device=torch.cuda.current_device()),
                torch.ones(2).to("cuda"), torch.ones(2).cuda(), torch.tensor([1.0, 2.0], device="cuda")]
        made.append(made[0].new_tensor([3.0]))  # on its tensor's device, as on CUDA
        with torch.device("cuda"):
            made.append(torch.nn.Linear(2, 2).weight)
        for t in made:
            assert isinstance(t, SimTensor) and t.device == torch.device("cuda", 0) and t.is_cuda
            assert t.type().startswith("torch.cuda.")
        host = made[2].cpu()
        assert type(host) is torch.Tensor and host.device.type == "cpu" and host.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("op", ["cat", "add", "matmul", "embedding", "cpu_indexed_by_device"])
def test_a_cpu_tensor_in_device_arithmetic_fails_as_on_cuda(op):
    """cat and add fail on the meta device too; matmul and embedding with CPU operands would pass there."""
    with simulated_cuda():
        x = torch.ones(3, 3, device="cuda")
        cpu = torch.ones(3, 3)
        run = {"cat": lambda: torch.cat([x, cpu]), "add": lambda: x + cpu, "matmul": lambda: x @ cpu,
               "embedding": lambda: torch.nn.functional.embedding(torch.zeros(2, dtype=torch.long), x),
               "cpu_indexed_by_device": lambda: cpu[torch.zeros(2, dtype=torch.long, device="cuda")]}[op]
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*cuda:0 and cpu"):
            run()


def test_what_cuda_allows_passes_with_real_values():
    with simulated_cuda():
        x = torch.arange(6.0, device="cuda").reshape(2, 3)
        assert (x * torch.tensor(2.0)).sum().item() == 30.0  # a 0-dim CPU tensor is a scalar
        assert x[torch.tensor([1])].tolist() == [[3.0, 4.0, 5.0]]  # indexing with CPU indices
        assert torch.nonzero(x > 3).tolist() == [[1, 1], [1, 2]]  # data-dependent shapes: real values
        x.copy_(torch.ones(2, 3))  # a copy between devices
        assert x.sum().item() == 6.0
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            x.numpy()


def test_backward_runs_and_equals_the_cpu_result():
    torch.manual_seed(0)
    w, inp = torch.randn(4, 3), torch.randn(5, 3)

    def grads(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        lin = torch.nn.Linear(3, 4, bias=False, device=device)
        with torch.no_grad():
            lin.weight.copy_(w)
        loss = lin(inp.to(device)).square().mean()
        loss.backward()
        return loss.detach().cpu(), lin.weight.grad.cpu()

    cpu = grads("cpu")
    with simulated_cuda():
        sim = grads("cuda")
    assert torch.equal(sim[0], cpu[0]) and torch.equal(sim[1], cpu[1])


def test_the_machine_is_restored_on_exit():
    megatron_cpu.apply()
    fixes = megatron_cpu.apply()
    get_backend, record_stream = dist.get_backend, torch.Tensor.record_stream
    env = dict(os.environ)
    with simulated_cuda():
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert "fix_current_device" not in megatron_cpu.apply()  # the machine "has" CUDA: Megatron's GPU paths run
        os.environ["QARL_SIMULATED_PROBE"] = "1"
    assert not torch.cuda.is_available() and megatron_cpu.apply() == fixes
    assert dist.get_backend is get_backend and torch.Tensor.record_stream is record_stream
    assert dict(os.environ) == env


# ------------------------------------------------------------------------------------------ the learner checks
@pytest.fixture(scope="module")
def simulated_checks(tmp_path_factory) -> dict[str, str]:
    """One run of ``python -m megatron_qarl.gpu.smoke simulate`` (its own process: the simulation changes
    process-wide state, and Megatron's parallel state lives there)."""
    proc = subprocess.run([sys.executable, "-m", "megatron_qarl.gpu.smoke", "simulate",
                           "--model", str(REPO / "checkpoints" / "tiny-qwen3-moe")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path_factory.mktemp("simulate"),
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    start = proc.stdout.find("{\n")
    assert start >= 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout[start:])
    assert proc.returncode == (1 if any(v.startswith("FAILED") for v in result["checks"].values()) else 0)
    return result["checks"]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("check", gpu_smoke.LEARNER_CHECKS)
def test_learner_check_on_the_simulated_device(simulated_checks, check, scheme):
    """r3_train_step: the server's routes (on the device, as train_step moves the batch) padded for TP with
    expert ids made on the CPU failed here before learner.py made them on the routes' device."""
    result = simulated_checks[f"{check}[local,{scheme}]"]
    assert result.startswith("ok"), result


def test_the_simulated_run_equals_the_cpu_run(simulated_checks):
    result = simulated_checks["simulated_equals_cpu[local,w4a16]"]
    assert result.startswith("ok: log-probs, loss and grad norm bit-identical"), result


def test_the_smoke_wants_a_model_it_can_find(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not a checkout: no checkpoints/tiny-qwen3-moe here
    with pytest.raises(SystemExit, match="--model: checkpoints/tiny-qwen3-moe holds no config.json"):
        gpu_smoke.model_dir(None)
    assert gpu_smoke.model_dir(str(REPO / "checkpoints" / "tiny-qwen3-moe")).endswith("tiny-qwen3-moe")


# ---------------------------------------------------------------------------------- clipping under optimizer offload
def _offload_clip(model_dir: str) -> dict:
    """A bf16 learner with ``optimizer_cpu_offload`` (Megatron's HybridDeviceOptimizer under its precision-aware
    distributed optimizer) on the simulated device: one backward, then its gradients clipped by the learner's
    ``clip_gradients`` and, from the same gradients, by Megatron's own ``clip_grad_norm`` of the same optimizer."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, clip_gradients, token_mean_nll
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import init_parallel, single_rank_env

    single_rank_env()
    dist.init_process_group("gloo")  # the simulated GPU has no NCCL: its groups are gloo
    torch.manual_seed(0)
    with simulated_cuda():
        init_parallel()
        arch = Qwen3MoeArch.from_model_dir(model_dir)
        learner = Learner(arch, ParallelConfig(), OptimConfig(clip_grad=0.5), dtype=torch.bfloat16,
                          optimizer_cpu_offload=True)
        learner.load_hf(model_dir)
        tokens, mask = torch.randint(0, arch.vocab_size, (2, 16)), torch.ones(2, 15)
        learner.model.zero_grad_buffer()
        learner.optimizer.zero_grad()
        token_mean_nll(learner.logprobs(tokens), Batch(tokens, mask).to(learner.device), 30)[0].backward()
        finalize_model_grads([learner.model])
        assert not learner.optimizer.prepare_grads()
        norm = float(learner.optimizer.get_grad_norm())
        params = [p for opt in learner.optimizer.chained_optimizers for p in opt.get_parameters()]
        held = [p for p in params if getattr(p, "decoupled_grad", None) is not None]
        before = [p.decoupled_grad.clone() for p in held]
        clip_gradients(learner.optimizer, 0.5, norm)  # what Learner.train_step clips with
        ours = [p.decoupled_grad.clone() for p in held]
        for p, g in zip(held, before, strict=True):
            p.decoupled_grad.copy_(g)
        megatron_norm = float(learner.optimizer.clip_grad_norm(0.5))
        theirs = [p.decoupled_grad.clone() for p in held]
        return {"norm": norm, "megatron_norm": megatron_norm, "params": len(params), "decoupled": len(held),
                "grads": sum(p.grad is not None for p in params),
                "scaled": [float(a.float().norm() / b.float().norm()) for a, b in zip(ours, before, strict=True)
                           if bool(b.any())],
                "equal": all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))}


def test_clipping_under_optimizer_offload_clips_as_megatron_does():
    """Issue 53 item 2: with learner.optimizer_cpu_offload the precision-aware distributed optimizer holds its shards'
    gradients in ``.decoupled_grad`` (``.grad`` stays None); the learner's clip scaled ``.grad`` only, so nothing was
    clipped while the logged norm (Megatron's, read from decoupled_grad) looked right. Now it passes
    ``use_decoupled_grad`` as Megatron's ``clip_grad_norm`` does: the same gradients, bit for bit."""
    from bounded_child import run_in_child

    out = run_in_child(_offload_clip, str(REPO / "checkpoints" / "tiny-qwen3-moe"), timeout_s=300,
                       name="offload clip")
    print(f"\noffload clip: norm {out['norm']:.3f}, {out['decoupled']} of {out['params']} shard params hold "
          f"decoupled_grad, {out['grads']} .grad; scaled by {min(out['scaled']):.4f}..{max(out['scaled']):.4f}")
    assert out["decoupled"] == out["params"] > 0 and out["grads"] == 0  # the precision-aware path was taken
    assert out["norm"] > 0.5 and out["megatron_norm"] == pytest.approx(out["norm"])
    coeff = 0.5 / (out["norm"] + 1e-6)
    assert all(s == pytest.approx(coeff, rel=1e-2) for s in out["scaled"]), out["scaled"]
    assert out["equal"]
