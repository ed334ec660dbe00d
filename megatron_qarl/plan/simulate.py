"""Learner memory by simulation: one rank of a run config's layout, at full model width, on a shape-only simulated
CUDA device, with every byte it allocates counted; what ``qarl plan --simulate`` sets beside the planner's figures.

``simulate_learner(cfg, layers=L)`` runs the REAL learner code of one rank: the ``Learner`` that ``qarl train``
builds from ``cfg`` (Megatron's model from ``cfg.model.path``'s config.json with ``L`` layers, our ModelOpt fake
quant, Megatron's DDP and (distributed) optimizer, the configured recompute and micro-batch) and two
``train_step``s with the config's policy loss on one micro-batch of full-length sequences per data-parallel rank;
the second step, whose optimizer state exists before it starts, is the one measured.

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
- **The tracker** (``AllocationTracker``): told of every tensor the device holds (``simulated_device`` reports each
  one it creates), it counts each storage once while any tensor holding it lives (a weakref finalizer on the
  device-side tensor), so its live bytes are what a caching allocator would have handed out (no rounding, no
  fragmentation: the planner's reserve). Each storage is labelled by what allocated it: ``weights`` (the model's
  parameters, and the DDP parameter buffer), ``gradients`` (the DDP gradient buffers), ``optimizer`` (allocated
  while the optimizer is built or steps: fp32 master copies, Adam's moments, and its transient buffers),
  ``qat_cache`` (while ``FakeQuant`` refreshes its codes: the fake-quant cache), ``activations`` (everything
  else during the forward / backward: activations, saved tensors, gradients in flight, logits), ``other``
  (rotary tables, RNG states, the batch: what was live before the step that is none of the above).
  ``peak`` is the highest live total of the measured step; ``at_peak`` its breakdown by label, which sums to it.

Layers: the per-layer terms of every phase are linear in L (a layer's parameters, its fake-quant cache, its saved
activations; full recompute: one kept input per chunk), so ``extrapolate`` fits a line through simulations at two
layer counts and evaluates it at the model's L; ``qarl plan --simulate --check-layers`` compares 2 / 4 / 8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator

import torch

from megatron_qarl.config import QarlConfig
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.plan.memory import micro_batch_sequences, step_shape

LABELS = ("weights", "gradients", "optimizer", "qat_cache", "activations", "other")


class AllocationTracker:
    """Live bytes of the storages of the simulated device's tensors, in total and by label, and their peak."""

    def __init__(self) -> None:
        self.label = "other"
        self.live = 0
        self.by_label: dict[str, int] = defaultdict(int)
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._storages: dict[int, list] = {}  # storage key -> [nbytes, tensors holding it, label]

    def add(self, data: torch.Tensor) -> None:
        """A tensor the device holds: its storage counts from now until the last such tensor of it is gone."""
        storage = data.untyped_storage()
        key = storage._cdata
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [storage.nbytes(), 0, self.label, (tuple(data.shape), data.dtype)]
            self.live += entry[0]
            self.by_label[entry[2]] += entry[0]
            if self.live > self.peak:
                self.peak = self.live
                self.at_peak = dict(self.by_label)
        entry[1] += 1
        weakref.finalize(data, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self.live -= entry[0]
            self.by_label[entry[2]] -= entry[0]

    def relabel(self, tensors, label: str) -> None:
        """Move the storages of ``tensors`` (device tensors) to ``label``."""
        from megatron_qarl.gpu.simulated_device import SimTensor

        for t in tensors:
            data = t._data if isinstance(t, SimTensor) else t
            entry = self._storages.get(data.untyped_storage()._cdata)
            if entry is not None and entry[2] != label:
                self.by_label[entry[2]] -= entry[0]
                entry[2] = label
                self.by_label[label] += entry[0]

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """Storages allocated inside the block get ``label`` (one of LABELS)."""
        if label not in LABELS:
            raise ValueError(f"label {label!r} is not one of {', '.join(LABELS)}")
        saved, self.label = self.label, label
        try:
            yield
        finally:
            self.label = saved

    def largest(self, n: int = 10, label: str | None = None) -> list[tuple[int, str, tuple]]:
        """The ``n`` largest live storages (of ``label``): (bytes, label, (shape, dtype) of the first tensor)."""
        rows = [(e[0], e[2], e[3]) for e in self._storages.values() if label is None or e[2] == label]
        return sorted(rows, key=lambda r: -r[0])[:n]

    def reset_peak(self) -> None:
        self.peak = self.live
        self.at_peak = dict(self.by_label)



@dataclasses.dataclass
class SimResult:
    """One simulated rank: bytes by label live at the peak of the measured step (``at_peak``, summing to ``peak``),
    and the run's facts."""

    layers: int
    peak: int
    at_peak: dict[str, int]
    seconds: float
    micro_batch_tokens: int

    @property
    def phases(self) -> dict[str, int]:
        """The planner's parts: weights, gradients, optimizer, activations, qat_cache (``other`` goes with the
        activations: what the step holds beyond the persistent state), and ``total`` = ``peak``."""
        p = {k: self.at_peak.get(k, 0) for k in ("weights", "gradients", "optimizer", "qat_cache")}
        p["activations"] = self.at_peak.get("activations", 0) + self.at_peak.get("other", 0)
        p["total"] = self.peak
        return p


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


def _batch(cfg: QarlConfig, dp: int, micro_sequences: int, seq_len: int):
    """One micro-batch of ``micro_sequences`` full-length sequences per data-parallel rank, with what the policy
    loss reads (advantages, old and sampler log-probs) and, for R3, the routes."""
    from megatron_qarl.learner.rank import Batch

    rows = dp * micro_sequences
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (rows, seq_len), generator=g)
    mask = torch.ones(rows, seq_len - 1)
    extra = {"adv_B": torch.randn(rows, generator=g), "logp_old_BT": -torch.rand(rows, seq_len - 1, generator=g),
             "logp_sampler_BT": -torch.rand(rows, seq_len - 1, generator=g)}
    return Batch(tokens, mask, extra)


@contextlib.contextmanager
def _labels(tracker: AllocationTracker) -> Iterator[None]:
    """Label what the optimizer and the fake-quant refresh allocate (their methods wrapped for the block)."""
    from megatron.core import optimizer as mopt

    from megatron_qarl.qat.modules import FakeQuant

    refresh, get_opt = FakeQuant._refresh, mopt.get_megatron_optimizer

    def labelled_refresh(self, t):
        with tracker.labelled("qat_cache"):
            return refresh(self, t)

    def labelled_get_opt(*args, **kwargs):
        with tracker.labelled("optimizer"):
            return get_opt(*args, **kwargs)

    FakeQuant._refresh, mopt.get_megatron_optimizer = labelled_refresh, labelled_get_opt
    try:
        yield
    finally:
        FakeQuant._refresh, mopt.get_megatron_optimizer = refresh, get_opt


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


def simulate_learner(cfg: QarlConfig, *, layers: int | None = None, micro_batch_tokens: int | None = None,
                     steps: int = 2, debug: bool = False) -> SimResult:
    """One rank of ``cfg``'s learner at full width with ``layers`` layers (None: the model's), shape-only (module
    docstring); ``micro_batch_tokens`` overrides the sequence length of the one-sequence-per-rank micro-batch."""
    from megatron_qarl.gpu.simulated_device import simulated_cuda
    from megatron_qarl.learner.rank import Learner, policy_loss_fn
    from megatron_qarl.moe.parallelize import destroy_parallel, init_parallel
    from megatron_qarl.wire import parse_dtype

    t0 = time.perf_counter()
    arch = _arch(cfg, layers)
    par = cfg.parallel
    dp = cfg.world_size // par.tp
    seq_len = step_shape(cfg)[1]
    micro = micro_batch_sequences(cfg, dp)
    if micro_batch_tokens is not None:
        micro, seq_len = 1, micro_batch_tokens
    tracker = AllocationTracker()
    _fake_world(cfg.world_size)
    try:
        with simulated_cuda(shapes_only=True, tracker=tracker), _labels(tracker):
            with _fake_side_groups():
                init_parallel(tp=par.tp, ep=par.ep, seed=cfg.seed)
            with tracker.labelled("weights"):
                le = cfg.learner
                learner = Learner(arch, par, cfg.optim, dtype=parse_dtype(cfg.model.dtype), quant=cfg.quant,
                                  aligned=le.aligned, micro_batch_size=micro,
                                  temperature=cfg.rollout.sampling.temperature, routing_replay=cfg.algo.wants_routes,
                                  impl=cfg.model.impl if cfg.model.impl != "auto" else "local",
                                  distributed_optimizer=le.distributed_optimizer,
                                  optimizer_cpu_offload=le.optimizer_cpu_offload,
                                  optimizer_offload_fraction=le.optimizer_offload_fraction,
                                  recompute=le.recompute, recompute_num_layers=le.recompute_num_layers)
            _relabel_model(learner, tracker)
            _wrap_optimizer(learner, tracker)
            _skip_host_adam(learner)
            batch = _batch(cfg, dp, micro, seq_len)
            loss_fn = policy_loss_fn(cfg.algo.loss, batch)
            for step in range(steps):
                if step == steps - 1:
                    if debug:
                        print("live before the measured step:", tracker.largest(12))
                    tracker.reset_peak()
                with tracker.labelled("activations"):
                    learner.train_step(batch, loss_fn)
            result = SimResult(layers=arch.num_hidden_layers, peak=tracker.peak, at_peak=dict(tracker.at_peak),
                               seconds=0.0, micro_batch_tokens=micro * seq_len)
            del learner, loss_fn
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
    finally:
        destroy_parallel()
    result.seconds = round(time.perf_counter() - t0, 1)
    return result


PHASES = ("weights", "gradients", "optimizer", "activations", "qat_cache", "total")


def extrapolate(a: SimResult, b: SimResult, layers: int) -> dict[str, int]:
    """Each phase (and the peak) at ``layers`` layers from simulations at two layer counts La < Lb, on the line
    through them: x(L) = x(La) + (x(Lb) - x(La)) * (L - La) / (Lb - La) (module docstring: every term is linear
    in L)."""
    if a.layers == b.layers:
        raise ValueError("extrapolate: two simulations with different layer counts are needed")
    pa, pb = a.phases, b.phases
    return {k: int(round(pa[k] + (pb[k] - pa[k]) * (layers - a.layers) / (b.layers - a.layers))) for k in PHASES}


def simulate_config(cfg: QarlConfig, *, layers: tuple[int, ...] = (2, 4)) -> dict:
    """Simulations of ``cfg``'s learner rank at each of ``layers`` (full width), the figures at the model's layer
    count extrapolated from the first two, and (three or more) each further count's extrapolated vs simulated
    peak: a JSON-ready dict, bytes."""
    full = Qwen3MoeArch.from_model_dir(cfg.model.path).num_hidden_layers
    sims = [simulate_learner(cfg, layers=n) for n in layers]
    out = {"model_layers": full, "layers": list(layers),
           "simulated": [{"layers": s.layers, "seconds": s.seconds, "micro_batch_tokens": s.micro_batch_tokens,
                          **s.phases} for s in sims],
           "extrapolated": extrapolate(sims[0], sims[1], full)}
    out["layer_check"] = [{"layers": s.layers, "simulated_total": s.peak,
                           "extrapolated_total": extrapolate(sims[0], sims[1], s.layers)["total"]} for s in sims[2:]]
    return out
