"""Learner memory by simulation: one rank of a run config's layout, at full model width, on a shape-only simulated
CUDA device, with every byte it allocates counted; what ``qarl plan --simulate`` sets beside the planner's figures.

``simulate_learner(cfg, layers=L)`` runs the REAL learner code of one rank: the ``Learner`` that ``qarl train``
builds from ``cfg`` (Megatron's model from ``cfg.model.path``'s config.json with ``L`` layers, our ModelOpt fake
quant, Megatron's DDP and (distributed) optimizer, the configured recompute and micro-batch), a first ``train_step``
with the config's policy loss on one micro-batch of full-length sequences per data-parallel rank (after it the
optimizer's state exists), then every phase of a training step the config runs (``plan.phases.PHASES``: the
log-prob forward, the R3 forward, the train step, the weight sync's payload on rank 0 and on another rank, the
checkpoint's state dicts, the evaluation-time forward), each measured on its own.

- **Device.** ``simulated_device.simulated_cuda(shapes_only=True)``: device tensors are meta tensors (shape,
  dtype, strides), except small bookkeeping ones with real values (routing maps, token counts, split sizes).
  Nothing is materialised: a 30B-parameter rank builds in no memory; the cost is Python's.
- **The other ranks.** One rank (global rank 0: TP rank 0, EP rank 0, DP rank 0) runs alone in a process group of
  the layout's world size on torch's fake backend (``torch.testing._internal.distributed.fake_pg``): every
  collective returns at once with outputs of the right shapes, and gathers / all-to-alls copy this rank's input
  into every peer's slot, i.e. the other ranks are taken to be copies of this one. The token counts the
  alltoall dispatcher exchanges are then those of balanced routing on every rank.
- **MoE routing.** The router's top-k of scores whose values are unknown is the balanced stand-in
  (``simulated_device._balanced_topk``): token t goes to experts (t*k + j) mod E, so every expert, and every EP
  rank, receives the mean number of (token, expert) pairs: T*k/E per expert. What it changes: real routing is
  imbalanced; the busiest rank's expert activations grow by its imbalance factor (the planner's
  ``expert_imbalance`` = 1.0 is this case); the dispatch is dropless, so no capacity padding is simulated.
- **The tracker** (``plan.tracker.AllocationTracker``): told of every tensor the device holds (``simulated_device``
  reports each one it creates), it counts each storage once while any tensor holding it lives (a weakref finalizer
  on the device-side tensor), so its live bytes are what a caching allocator would have handed out, and beside them
  the allocator's rounding. Each storage is labelled by what allocated it (``plan.tracker.LABELS``: the persistent
  state, and the activation kinds: core attention, experts, logits, communication buffers, the rest of a layer).
  Each phase's peak is the highest live total during it; its breakdown by label sums to it.

Layers: the per-layer terms of every phase but the sync are linear in L (a layer's parameters, its fake-quant cache,
its saved activations; full recompute: a kept input and a gradient per chunk), so ``extrapolate`` fits a line
through simulations at two layer counts and evaluates it at the model's L; the sync's peak is bounded by its bucket
(``plan.sim_check`` compares it at the simulated counts), its byte counts are linear. ``qarl plan --simulate
--simulate-layers 2 4 8`` checks the line at 8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from megatron_qarl.config import QarlConfig
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.plan.memory import micro_batch_sequences, step_shape
from megatron_qarl.plan.phases import PHASE_NAMES, phases_of
from megatron_qarl.plan.tracker import ACTIVATION_KINDS, LABELS, PERSISTENT, AllocationTracker


@dataclasses.dataclass
class SimResult:
    """One simulated rank: per phase (``plan.phases``), the bytes by label live at that phase's peak (summing to its
    ``total``); the weight sync's payload as rank 0 sent it (``sync``: bytes, tensors, buckets, low-bit bytes);
    and the run's facts."""

    layers: int
    phases: dict[str, dict[str, int]]
    sync: dict[str, int]
    seconds: float
    micro_batch_tokens: int
    modules: str = ""  # the learner's experts and core attention as built ("grouped experts, sdpa attention")

    def terms(self, phase: str = "train_step") -> dict[str, int]:
        """``phase``'s peak by the planner's terms: the persistent ones, ``activations`` (every activation kind),
        each kind on its own, and ``total``."""
        at = self.phases[phase]
        out = {k: at.get(k, 0) for k in PERSISTENT}
        out["activations"] = sum(at.get(k, 0) for k in ACTIVATION_KINDS)
        out.update({k: at.get(k, 0) for k in ACTIVATION_KINDS})
        out["total"] = at["total"]
        return out


def _arch(cfg: QarlConfig, layers: int | None) -> Qwen3MoeArch:
    arch = Qwen3MoeArch.from_model_dir(cfg.model.path)
    return arch if layers is None else dataclasses.replace(arch, num_hidden_layers=layers)


def _fake_world(world: int) -> None:
    """This process as rank 0 of ``world`` on torch's fake backend (module docstring: the other ranks)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("plan.simulate: a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


@contextlib.contextmanager
def _fake_side_groups() -> Iterator[None]:
    """Megatron's gloo side groups (created with backend="gloo" by ``initialize_model_parallel``) as fake ones
    too: gloo cannot form a group of ranks that do not exist."""
    import torch.distributed as dist

    new_group = dist.new_group

    def fake_new_group(*args, **kwargs):
        if str(kwargs.get("backend") or "").lower() == "gloo":
            kwargs["backend"] = "fake"
        return new_group(*args, **kwargs)

    dist.new_group = fake_new_group
    try:
        yield
    finally:
        dist.new_group = new_group


def _batch(cfg: QarlConfig, dp: int, micro_sequences: int, seq_len: int, vocab_size: int):
    """One micro-batch of ``micro_sequences`` full-length sequences per data-parallel rank (token ids below 1000 and
    the model's ``vocab_size``), with what the policy loss reads (advantages, old and sampler log-probs) and, for R3,
    the routes."""
    from megatron_qarl.learner.rank import Batch

    rows = dp * micro_sequences
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(1000, vocab_size), (rows, seq_len), generator=g)
    mask = torch.ones(rows, seq_len - 1)
    extra = {"adv_B": torch.randn(rows, generator=g), "logp_old_BT": -torch.rand(rows, seq_len - 1, generator=g),
             "logp_sampler_BT": -torch.rand(rows, seq_len - 1, generator=g)}
    return Batch(tokens, mask, extra)


@contextlib.contextmanager
def _labels(tracker: AllocationTracker) -> Iterator[None]:
    """Label what the optimizer and the fake-quant refresh allocate, and the vocab-parallel cross entropy's
    tensors (``act_logits``): their functions wrapped for the block."""
    from megatron.core import optimizer as mopt
    from megatron.core import tensor_parallel

    from megatron_qarl.qat.modules import FakeQuant

    saved = (FakeQuant._refresh, mopt.get_megatron_optimizer, tensor_parallel.vocab_parallel_cross_entropy)
    refresh = saved[0]

    def labelled_refresh(self, t):
        with tracker.labelled("qat_cache"):
            return refresh(self, t)

    FakeQuant._refresh = labelled_refresh
    mopt.get_megatron_optimizer = _labelled_call(tracker, "optimizer", saved[1])
    tensor_parallel.vocab_parallel_cross_entropy = _labelled_call(tracker, "act_logits", saved[2])
    try:
        yield
    finally:
        FakeQuant._refresh, mopt.get_megatron_optimizer, tensor_parallel.vocab_parallel_cross_entropy = saved


def _wrap_optimizer(learner, tracker: AllocationTracker) -> None:
    """The optimizer's step-time methods allocate under the ``optimizer`` label."""
    opt = learner.optimizer
    for name in ("prepare_grads", "step_with_ready_grads", "get_grad_norm", "zero_grad"):
        method = getattr(opt, name)

        def labelled(*args, _method=method, **kwargs):
            with tracker.labelled("optimizer"):
                return _method(*args, **kwargs)

        setattr(opt, name, labelled)


def _skip_host_adam(learner) -> None:
    """Optimizer CPU offload: the host-side Adam arithmetic of the offloaded shard (torch's CPU Adam over host
    tensors, ``optimizer_host_bytes`` of them) is skipped; its post-step hooks, which copy the parameters back to
    the device, still run. It allocates nothing on the device, and on this machine it would need the host memory
    of a real rank."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    for opt in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, HybridDeviceOptimizer):
            continue
        for cpu_opt in inner.cpu_optimizers:
            def step(*args, _opt=cpu_opt):  # (closure=None)
                for hook in list(_opt._optimizer_step_post_hooks.values()):
                    hook(_opt, (), {})

            cpu_opt.step = step


def _relabel_model(learner, tracker: AllocationTracker) -> None:
    """Parameters (and DDP's parameter buffers) are weights; DDP's gradient buffers are gradients."""
    model = learner.model
    tracker.relabel(list(learner.module.parameters()), "weights")
    for buf in list(getattr(model, "buffers", [])) + list(getattr(model, "expert_parallel_buffers", [])):
        if getattr(buf, "param_data", None) is not None:
            tracker.relabel([buf.param_data], "weights")
        if getattr(buf, "grad_data", None) is not None:
            tracker.relabel([buf.grad_data], "gradients")


_KIND_OF_MODULE = (("core_attention", "act_attention"), ("mlp.experts", "act_experts"), ("output_layer", "act_logits"))


def _label_kinds(learner, tracker: AllocationTracker) -> None:
    """What the core attention, the routed experts and the output layer allocate (in a forward, or its recompute in
    the backward) gets their activation kind; the MoE dispatcher's all-to-alls ``comm_buffers``; the vocab-parallel
    cross entropy ``act_logits`` (``_labels``). Hooks on the modules set and restore the tracker's label."""
    saved: list[str] = []

    def enter(label):
        def pre(*_):
            saved.append(tracker.label)
            tracker.label = label
        return pre

    def leave(*_):
        tracker.label = saved.pop()

    for name, module in learner.module.named_modules():
        for suffix, label in _KIND_OF_MODULE:
            if name.endswith(suffix):
                module.register_forward_pre_hook(enter(label))
                module.register_forward_hook(leave)
        dispatcher = getattr(module, "token_dispatcher", None)
        if dispatcher is not None:
            for method in ("token_dispatch", "token_combine"):
                setattr(dispatcher, method, _labelled_call(tracker, "comm_buffers", getattr(dispatcher, method)))


def _labelled_call(tracker: AllocationTracker, label: str, fn):
    def call(*args, **kwargs):
        with tracker.labelled(label):
            return fn(*args, **kwargs)
    return call


def _sync_payload(learner, cfg: QarlConfig, sender: bool, tracker: AllocationTracker) -> dict[str, int]:
    """The weight sync's payload (``sync.payload.iter_sync_tensors``) as one learner rank lives it: rank 0
    (``sender``) fills ``BroadcastTransport.session``'s buckets of rollout.sync.bucket_mb, each dropped once sent
    (the broadcast itself moves no device memory); another rank takes part in the gathers only. Returns what rank 0
    sent: bytes, tensors, buckets, and the bytes of the low-bit tensors (codes, scales, shapes)."""
    from megatron_qarl.sync.payload import iter_sync_tensors
    from megatron_qarl.sync.transport import BroadcastTransport
    from megatron_qarl.wire import parse_dtype

    if learner.fake_quant:  # as after the train step that precedes every sync: the cache refills as it goes
        learner.fake_quant.invalidate()
    with tracker.labelled("comm_buffers"):
        tensors = iter_sync_tensors(learner, parse_dtype(cfg.rollout.dtype))
        if not sender:
            for _ in tensors:
                pass
            return {}
        report = SimpleNamespace(bytes=0, tensors=0, buckets=0, low_bit=0)
        high = (torch.bfloat16, torch.float16, torch.float32)

        def send(bucket, version, report, checksums, load_format=None):
            for name, t in bucket:
                n = t.numel() * t.element_size()
                report.bytes += n
                report.tensors += 1
                report.low_bit += n if t.dtype not in high or "weight_" in name.rsplit(".", 1)[-1] else 0
            report.buckets += 1

        transport = BroadcastTransport([], master_port=1, bucket_bytes=cfg.rollout.sync.bucket_mb << 20)
        transport.send = send
        transport.session(([item] for item in tensors), "v1", report, None, None)
    return {"bytes": report.bytes, "tensors": report.tensors, "buckets": report.buckets, "low_bit": report.low_bit}


def _checkpoint_state(learner, cfg: QarlConfig, tracker: AllocationTracker):
    """What ``learner.checkpoint.save_learner`` builds on the device before dist-checkpointing writes it (through
    host memory): the model's and the optimizer's sharded state dicts, returned so that they live to the phase's
    end. With optimizer CPU offload the optimizer's state is host tensors (whose Adam step ``_skip_host_adam`` does
    not run, so it has no state to build here): its state dict allocates nothing on the device and is left out."""
    from megatron_qarl.learner.checkpoint import allocate_optimizer_state, optimizer_metadata

    with tracker.labelled("act_checkpoint"):
        model_sd = learner.module.sharded_state_dict()
        if cfg.learner.optimizer_cpu_offload:
            return model_sd
        allocate_optimizer_state(learner.optimizer)
        return model_sd, learner.optimizer.sharded_state_dict(
            model_sd, metadata=optimizer_metadata(cfg.train.checkpoint.optimizer_format))


def _phase_runs(learner, cfg: QarlConfig, batch, loss_fn, tracker: AllocationTracker, sync: dict) -> dict:
    """Each phase of ``plan.phases.PHASES`` as the simulation runs it (a callable per phase name)."""
    def r3():
        _, own = learner.forward_routes(batch.tokens_BS)
        learner.forward_routes(batch.tokens_BS, own)

    return {
        "logprob_forward": lambda: learner.forward_logprobs(batch.tokens_BS),
        "r3_forward": r3,
        "train_step": lambda: learner.train_step(batch, loss_fn),
        "sync_sender": lambda: sync.update(_sync_payload(learner, cfg, True, tracker)),
        "sync_peer": lambda: _sync_payload(learner, cfg, False, tracker),
        "checkpoint_save": lambda: _checkpoint_state(learner, cfg, tracker),
        "eval_forward": lambda: learner.forward_logprobs(batch.tokens_BS, temperature=1.0),
    }


def _build_learner(cfg: QarlConfig, arch: Qwen3MoeArch, micro: int, real_device: bool = False):
    """The learner ``qarl train`` builds from ``cfg`` (local spec). On the simulated device (``real_device`` False)
    the refresh runs torch's ops, whatever learner.refresh_kernel / compile_quantizer say: it cannot run Triton or
    inductor kernels, and the torch path's temporaries bound theirs from above; on a real one (plan/measure.py), as
    configured."""
    from megatron_qarl.learner.rank import Learner
    from megatron_qarl.qat.kv_cache import run_spec
    from megatron_qarl.wire import parse_dtype

    le = cfg.learner
    kernels = ({"refresh_kernel": le.refresh_kernel, "compile_quantizer": le.compile_quantizer} if real_device
               else {"refresh_kernel": "torch"})
    return Learner(arch, cfg.parallel, cfg.optim, dtype=parse_dtype(cfg.model.dtype), quant=cfg.quant,
                   aligned=le.aligned, micro_batch_size=micro, temperature=cfg.rollout.sampling.temperature,
                   routing_replay=cfg.algo.wants_routes, impl=cfg.model.impl if cfg.model.impl != "auto" else "local",
                   attention=cfg.model.attention,
                   distributed_optimizer=le.distributed_optimizer, optimizer_cpu_offload=le.optimizer_cpu_offload,
                   optimizer_offload_fraction=le.optimizer_offload_fraction, recompute=le.recompute,
                   recompute_num_layers=le.recompute_num_layers, experts=cfg.model.experts,
                   kv_cache=run_spec(cfg, arch.num_hidden_layers), **kernels)


def simulate_learner(cfg: QarlConfig, *, layers: int | None = None, micro_batch_tokens: int | None = None,
                     phases: tuple[str, ...] | None = None, debug: bool = False) -> SimResult:
    """One rank of ``cfg``'s learner at full width with ``layers`` layers (None: the model's), shape-only (module
    docstring): a first ``train_step`` (the optimizer's state exists after it), then each of ``phases`` (None: the
    ones ``cfg`` runs, ``plan.phases.phases_of``) in the table's order, each with its own peak.
    ``micro_batch_tokens`` overrides the sequence length of a one-sequence-per-rank micro-batch."""
    from megatron_qarl.gpu.simulated_device import simulated_cuda
    from megatron_qarl.learner.rank import policy_loss_fn
    from megatron_qarl.moe.parallelize import destroy_parallel, init_parallel

    t0 = time.perf_counter()
    arch = _arch(cfg, layers)
    dp = cfg.world_size // cfg.parallel.tp
    seq_len = step_shape(cfg)[1]
    micro = micro_batch_sequences(cfg, dp)
    if micro_batch_tokens is not None:
        micro, seq_len = 1, micro_batch_tokens
    wanted = [p.name for p in phases_of(cfg)] if phases is None else [p for p in PHASE_NAMES if p in phases]
    tracker = AllocationTracker()
    _fake_world(cfg.world_size)
    measured, sync = {}, {}
    try:
        with simulated_cuda(shapes_only=True, tracker=tracker), _labels(tracker):
            with _fake_side_groups():
                init_parallel(tp=cfg.parallel.tp, ep=cfg.parallel.ep, seed=cfg.seed)
            with tracker.labelled("weights"):
                learner = _build_learner(cfg, arch, micro)
            modules = f"{learner.experts} experts, {learner.attention} attention"
            _relabel_model(learner, tracker)
            _wrap_optimizer(learner, tracker)
            _skip_host_adam(learner)
            _label_kinds(learner, tracker)
            batch = _batch(cfg, dp, micro, seq_len, arch.vocab_size)
            loss_fn = policy_loss_fn(cfg.algo.loss, batch)
            runs = _phase_runs(learner, cfg, batch, loss_fn, tracker, sync)
            with tracker.labelled("act_layer"):
                learner.train_step(batch, loss_fn)
                tracker.keep_peak_storages = debug
                for name in wanted:
                    tracker.reset_peak()
                    kept = runs[name]()
                    measured[name] = tracker.phase_peak()
                    if debug:
                        print(f"{name}: the largest storages at its peak:", tracker.peak_storages[:12])
                    del kept
            del learner, loss_fn, runs
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
    finally:
        destroy_parallel()
    return SimResult(layers=arch.num_hidden_layers, phases=measured, sync=sync,
                     seconds=round(time.perf_counter() - t0, 1), micro_batch_tokens=micro * seq_len, modules=modules)


def _line(xa: float, xb: float, la: int, lb: int, layers: int) -> int:
    return int(round(xa + (xb - xa) * (layers - la) / (lb - la)))


def extrapolate(a: SimResult, b: SimResult, layers: int) -> dict:
    """Every phase's bytes by label (and total), and the sync's counts, at ``layers`` layers from simulations at two
    layer counts La < Lb, on the line through them: x(L) = x(La) + (x(Lb) - x(La)) * (L - La) / (Lb - La) (module
    docstring: every term is linear in L)."""
    if a.layers == b.layers:
        raise ValueError("extrapolate: two simulations with different layer counts are needed")
    phases = {name: {k: _line(a.phases[name][k], b.phases[name][k], a.layers, b.layers, layers)
                     for k in (*LABELS, "total", "rounding") if k in a.phases[name]} for name in a.phases}
    sync = {k: _line(a.sync[k], b.sync[k], a.layers, b.layers, layers) for k in a.sync}
    return {"phases": phases, "sync": sync}


def _record(s: SimResult) -> dict:
    return {"layers": s.layers, "seconds": s.seconds, "micro_batch_tokens": s.micro_batch_tokens,
            "phases": s.phases, "sync": s.sync, "modules": s.modules}


def simulate_config(cfg: QarlConfig, *, layers: tuple[int, ...] = (2, 4)) -> dict:
    """Simulations of ``cfg``'s learner rank at each of ``layers`` (full width), every phase at the model's layer
    count extrapolated from the first two, and (three or more) each further count's extrapolated vs simulated
    peaks: a JSON-ready dict, bytes."""
    full = Qwen3MoeArch.from_model_dir(cfg.model.path).num_hidden_layers
    sims = [simulate_learner(cfg, layers=n) for n in layers]
    out = {"model_layers": full, "layers": list(layers), "simulated": [_record(s) for s in sims],
           "extrapolated": extrapolate(sims[0], sims[1], full)}
    out["layer_check"] = [{"layers": s.layers, "phase": name, "simulated_total": s.phases[name]["total"],
                           "extrapolated_total": extrapolate(sims[0], sims[1], s.layers)["phases"][name]["total"]}
                          for s in sims[2:] for name in s.phases]
    return out
