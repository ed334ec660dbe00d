"""Fake quantization inside the Megatron model: NVIDIA ModelOpt's quant modules, driven by the one quantizer.

`apply_fake_quant(model, arch, cfg)`:
  1. ``mtq.quantize`` (ModelOpt's Megatron plugin) turns the Megatron linears the scheme quantizes into ModelOpt
     quant modules (ColumnParallelLinear -> QuantColumnParallelLinear, RowParallelLinear -> QuantRowParallelLinear;
     on the Transformer Engine spec ModelOpt's TE plugin converts TELayerNormColumnParallelLinear,
     TE{Column,Row}ParallelLinear and the TE grouped expert linears), each with a weight and an input
     TensorQuantizer. ModelOpt converts by class: the classes of modules the scheme leaves alone are kept out of
     its registry meanwhile (``_convert_only``), unless quantized modules share them. The weight quantizers run the
     ModelOpt backend ``qarl_weight``, the W8A8 input quantizers the backend ``qarl_act`` (both registered here with
     ``register_quant_backend``); ModelOpt applies them to the linear functional's operands. On the TE spec those
     functionals are TE's own GEMMs, run in the operands' precision: ModelOpt's TE plugin raises in every forward
     under TE's fp8 autocast (``_assert_te_fp8_enabled``, ModelOpt 0.47), so w8a8_fp8's FP8 is the operands'
     values (codes x scales), not TE's FP8 GEMMs (docs/quantization.md). A model built with TE's FP8 recipe
     (TransformerConfig.fp8, ``model.te_fp8``: bf16 and w4a16 only, ``moe.te.check_te_fp8``) runs each converted
     module with fp8 autocast off inside (``_outside_fp8_autocast``): w4a16's experts compute on their fake-quant
     weights, attention and the other TE GEMMs stay in FP8; a converted module the scheme does not quantize is
     refused there.
  2. Quantizers of converted linears whose Hugging Face tensors the config does not quantize (compressed-tensors
     targets / ignore semantics, ``qat.config.is_quantized``: the router, lm_head, attention under w4a16, ...)
     are disabled: those modules compute in high precision.
  3. Each enabled quantizer is bound to its target, which computes (STE = straight-through backward):

        weight  <- straight_through(w, hf_to_shard(dequantize(quantize(hf_tensors(gathered w)))))
        input   <- straight_through(x, quant_act(x))                       (W8A8 schemes only)

The unit of quantization is always the Hugging Face tensor the rollout engine loads (q_proj, k_proj, v_proj
separately, gate_proj and up_proj separately), never Megatron's fused or sharded one: when a layer is split over
tensor / expert-tensor parallel ranks, the shards are all-gathered, quantized whole and sliced back, so the
learner's low-bit weights equal the exported ones for any layout. Row-parallel inputs (split along K) are
gathered the same way for the W8A8 per-token scales.

Codes are refreshed once per weight version, not per forward: a target keeps its QuantizedWeights until the
master parameter's version (``_version``, ``data_ptr``) changes or ``invalidate()`` is called (the learner calls
it after every optimizer step), and ``target_codes(t)`` hands the weight sync (sync/payload.py) those very codes
and scales: nothing is quantized twice.

Why not ModelOpt's own numerics: its INT4 fake quant rounds with an fp32 scale and codes in [-7, 7]; SGLang's
Marlin kernel serves a bf16 scale and codes in [-8, 7] (docs/quantization.md has the measured difference), and
its quantizers see Megatron's fused, sharded tensors. ModelOpt inserts and owns the quantizers; the numerics and
the HF-tensor unit are ours, reached through its backend hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from megatron_qarl.moe.convert import Layout, ParamMap, hf_to_shard, model_impl, param_maps, shards_to_hf
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.parallelize import all_gather_tensors, to_group_device
from megatron_qarl.qat.config import QuantConfig, is_quantized, quant_sequential_mlp_applies
from megatron_qarl.qat.fake_quant import fake_quant_act, straight_through
from megatron_qarl.qat.quantizer import QuantizedWeight, fake_quantize_weight, scales_finite

WEIGHT_BACKEND = "qarl_weight"
ACT_BACKEND = "qarl_act"

# Megatron parameter split kinds that are linear weights, and whether K (dim 1) is the split dim
_LINEAR_SPLITS = {"qkv": False, "tp_row": False, "tp_col": True, "fc1": False, "fc2": True}

# a stack refresh quantizes at most this many bytes (fp32) in one call. On a GPU, where each op is a launch: one call
# per layer and projection up to 256 MiB (Qwen3-30B-A3B's fc1, 128 experts x 1536 x 2048, in a few), bounding the
# call's temporaries. On a CPU, where the refresh is memory bound, a cache's worth: measured here, 16 experts of
# [1536, 2048] quantized stacked took 2x as long as one by one (each then stays in cache between its passes)
GROUP_BYTES = {"cuda": 256 << 20, "cpu": 8 << 20}

REFRESH_KERNELS = ("auto", "torch", "triton")

# False: every expert weight refreshes alone (one quantizer call per Hugging Face tensor, after its own expert-TP
# all_gather at ETP > 1), for models built from then on: the path the stacks are tested against, bit for bit
STACK_EXPERTS = True

# TensorQuantizer -> the function its backend calls (set by FakeQuant; weak: a dropped model frees its entries)
_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _dispatch(x: Tensor, quantizer) -> Tensor:
    fn = _BOUND.get(quantizer)
    if fn is None:
        raise RuntimeError(f"a ModelOpt quantizer with backend {quantizer.backend!r} was not bound by "
                           "megatron_qarl.qat.modules.apply_fake_quant (was the model quantized elsewhere?)")
    return fn(x)


@contextlib.contextmanager
def _replace_function(package, name, new_func, og_func_cache_name=None):
    """ModelOpt's ``replace_function`` (modelopt/torch/quantization/utils/core_utils.py), restoring on an exception
    too. Why: a quant module of Megatron's runs its forward inside it, with Megatron's linear functional
    (``linear_with_grad_accumulation_and_async_allreduce``) replaced by one bound to that module; ModelOpt 0.47
    restores it only on a normal exit, so a forward that raised (a weight the scheme cannot quantize, an OOM) left
    the package's functional bound to the failed module, and every later forward of every model in the process ran
    that module's linear (RecursionError, or its weights and errors)."""
    cache = og_func_cache_name or "_" + name
    old = getattr(package, name)
    setattr(package, name, new_func)
    setattr(package, cache, old)
    try:
        yield
    finally:
        setattr(package, name, old)
        delattr(package, cache)


def register_backends() -> None:
    """Register the two ModelOpt backends (idempotent), and give ModelOpt's functional quant modules (Megatron's and
    TE's linears: ``plugins.custom``) the ``replace_function`` that restores on an exception (``_replace_function``)."""
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (
        is_registered_quant_backend,
        register_quant_backend,
    )
    from modelopt.torch.quantization.plugins import custom

    for name in (WEIGHT_BACKEND, ACT_BACKEND):
        if not is_registered_quant_backend(name):
            register_quant_backend(name, _dispatch)
    custom.replace_function = _replace_function
    _register_grouped_linear()


def _register_grouped_linear() -> None:
    """ModelOpt's quant module for moe/grouped.py's GroupedLinear (idempotent): a ModelOpt linear
    (``QuantLinearConvBase``: an input quantizer on its first argument, the routed tokens of the layer; a weight
    quantizer on ``weight``, the stack of its experts), converted by ``mtq.quantize`` like Megatron's linears."""
    from modelopt.torch.quantization.nn import QuantModuleRegistry
    from modelopt.torch.quantization.nn.modules.quant_module import QuantLinearConvBase

    from megatron_qarl.moe.grouped import GroupedLinear

    if GroupedLinear in QuantModuleRegistry:
        return

    class QuantGroupedLinear(QuantLinearConvBase):
        """GroupedLinear with ModelOpt's input and weight quantizers (bound to the one quantizer by FakeQuant), the
        expert groups as ModelOpt's parallel state (as its TEGroupedMLP plugin gives its expert linears)."""

        def _setup(self):
            from megatron.core import parallel_state as ps
            from modelopt.torch.utils.distributed import ParallelState

            super()._setup()
            self.parallel_state = ParallelState(ps.get_expert_data_parallel_group(),
                                                tensor_parallel_group=ps.get_expert_tensor_parallel_group(),
                                                expert_model_parallel_group=ps.get_expert_model_parallel_group())

    QuantModuleRegistry.register({GroupedLinear: "megatron_qarl_GroupedLinear"})(QuantGroupedLinear)


def modelopt_config(cfg: QuantConfig) -> dict:
    """The ``mtq.quantize`` config: every weight quantizer on our backend; input quantizers on ``qarl_act`` for
    W8A8 schemes, off for weight-only ones; output quantizers off. No calibration (our scales are dynamic)."""
    act = ({"enable": True, "cfg": {"backend": ACT_BACKEND}} if cfg.scheme in ("w8a8_fp8", "w8a8_int8")
           else {"enable": False})
    return {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "enable": True, "cfg": {"backend": WEIGHT_BACKEND}},
            {"quantizer_name": "*input_quantizer", **act},
        ],
        "algorithm": None,
    }


@contextlib.contextmanager
def _sequential_mlp_as_children(model: torch.nn.Module, lay: Layout):
    """ModelOpt 0.47's QuantSequentialMLP refuses TP > 1 with EP > 1: its sharded state of calibrated amax gets the
    expert-TP replica ids wrong when the experts are split over TP (ETP > 1). Here ETP is 1 whenever EP > 1
    (``moe.model.expert_tp``) and our quantizers hold no calibrated state, so at TP > 1 with EP > 1 the
    SequentialMLP container stays a Megatron module during ``mtq.quantize`` (its expert linears are still
    converted), and its expert linears get the parallel state QuantSequentialMLP would give them."""
    if quant_sequential_mlp_applies(lay.tp, lay.ep):
        yield
        return
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.experts import SequentialMLP
    from modelopt.torch.quantization.nn import QuantModuleRegistry
    from modelopt.torch.utils.distributed import ParallelState

    key = QuantModuleRegistry.get_key(SequentialMLP)
    base = QuantModuleRegistry._registry[SequentialMLP]  # the plugin class, to re-register it unchanged
    QuantModuleRegistry.unregister(SequentialMLP)
    try:
        yield
    finally:
        QuantModuleRegistry.register({SequentialMLP: key})(base)
    state = ParallelState(ps.get_expert_data_parallel_group(),
                          tensor_parallel_group=ps.get_expert_tensor_parallel_group(),
                          expert_model_parallel_group=ps.get_expert_model_parallel_group())
    for module in model.modules():
        if isinstance(module, SequentialMLP):
            for expert in module.local_experts:
                expert.linear_fc1.parallel_state = expert.linear_fc2.parallel_state = state


@contextlib.contextmanager
def _convert_only(model: torch.nn.Module, names: set[str], fp8: object):
    """ModelOpt converts every module whose class its registry holds (``mtq.quantize``). While it runs, the
    registered classes of the modules that are neither quantized (``names``) nor hold a quantized one are taken out
    of the registry, so that ModelOpt converts only what the scheme quantizes: on the TE spec with w4a16 the expert
    GEMMs (TE grouped linears), not attention's TE linears nor TE's core attention. A class that quantized and
    unquantized modules share (the local spec: attention and the experts are the same Column/RowParallelLinear)
    stays, and those modules are converted with their quantizers off; with ``fp8`` (TE's fp8 autocast, which every
    converted TE module's forward refuses) the caller refuses such a model."""
    from modelopt.torch.quantization.nn import QuantModuleRegistry as registry

    needed = {n for n in names} | {n.rsplit(".", i)[0] for n in names for i in range(1, n.count(".") + 1)} | {""}
    keep, skip = set(), set()
    for name, module in model.named_modules():
        cls = registry._get_registered_nn_class(type(module))
        if cls is not None:
            (keep if name in needed else skip).add(cls)
    saved = {cls: (registry.get_key(cls), registry._registry[cls]) for cls in skip - keep}
    for cls in saved:
        registry.unregister(cls)
    try:
        yield
    finally:
        for cls, (key, dm_class) in saved.items():
            registry.register({cls: key})(dm_class)


def _outside_fp8_autocast(module: torch.nn.Module) -> None:
    """Run ``module``'s forward with TE's fp8 autocast off inside (``model.te_fp8``: Megatron enters it around each
    layer; TE restores the outer state on exit). Its GEMMs then compute in the operands' precision on the fake-quant
    weights, as ModelOpt's TE plugin requires (``_assert_te_fp8_enabled``), and the backward follows (TE saves the
    forward's FP8 state with it)."""
    from transformer_engine.pytorch import fp8_autocast

    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with fp8_autocast(enabled=False):
            return inner(*args, **kwargs)

    module.forward = forward


@dataclasses.dataclass
class _Target:
    pm: ParamMap
    module: torch.nn.Module  # the ModelOpt quant module
    param: torch.nn.Parameter  # the master weight
    weight_quantizer: torch.nn.Module
    input_quantizer: torch.nn.Module
    group: object | None  # process group the weight is split over (None: not split)
    size: int
    rank: int
    splits_k: bool
    version: tuple | None = None
    quantized: dict[str, QuantizedWeight] | None = None
    local_fq: Tensor | None = None  # dequantized local shard (no autograd), in the master's dtype
    finite: Tensor | None = None  # 0-dim bool on the device: every scale finite (refreshed alone)
    stack: _Stack | None = None  # the targets refreshed with it by one quantizer call, else None (alone)
    index: int = 0  # its place in the stack
    st: dict[bool, Tensor] = dataclasses.field(default_factory=dict)  # grad mode -> the forward's weight
    expert: int | None = None  # grouped experts (moe/grouped.py): the row of ``param`` that is this target's weight

    @property
    def master(self) -> Tensor:
        """The master weight of this target: ``param``, or its row ``expert`` (a view, taken anew each time: DDP
        moves a parameter's data into its buffer after the quantizers are bound)."""
        return self.param if self.expert is None else self.param[self.expert]

    @property
    def shape(self) -> torch.Size:
        """The master weight's shape (no view taken)."""
        return self.param.shape if self.expert is None else self.param.shape[1:]

    def version_key(self) -> tuple:
        """What changes when the master weight does (no view taken: a row shares its parameter's version counter;
        the data pointer changes when DDP moves the parameter into its buffer)."""
        return self.param._version, self.param.data_ptr(), self.expert


@dataclasses.dataclass(eq=False)
class _GroupedWeight:
    """The weight of a grouped expert linear (moe/grouped.py, all the layer's experts in one parameter [E, N, K]):
    its targets, one per expert in order, whose dequantized weights, stacked, are what the grouped matmul multiplies.
    Where one stack holds them all (the usual case) that is the stack's ``fq`` as it is (a view); where the experts
    span several stacks (``GROUP_BYTES``) or refresh alone, the pieces are concatenated once per weight version and
    the stacks' and targets' weights become views of the result (one copy of the weights is held, not two)."""

    param: torch.nn.Parameter
    targets: list[_Target]
    fq: Tensor | None = None  # [E, N, K], no autograd
    key: tuple = ()  # identities of the pieces ``fq`` was made of
    st: dict[bool, Tensor] = dataclasses.field(default_factory=dict)  # grad mode -> the forward's weight

    def weight(self) -> Tensor:
        """The stacked fake-quant weight with a straight-through gradient to ``param`` (targets refreshed)."""
        pieces = self._pieces()
        key = tuple(id(p) for p in pieces)
        if key != self.key:
            with torch.no_grad():
                full = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                self.fq, self.key, self.st = full.view(self.param.shape), key, {}
                if len(pieces) > 1:
                    _repoint(self.targets, self.fq)
                    self.key = tuple(id(p) for p in self._pieces())
        mode = torch.is_grad_enabled()
        if mode not in self.st:
            self.st[mode] = straight_through(self.param, self.fq)
        return self.st[mode]

    def heads(self) -> list[_Target]:
        """The first target of each stack and every lone target, in expert order: refreshing them refreshes all."""
        out, seen = [], set()
        for t in self.targets:
            unit = id(t.stack if t.stack is not None else t)
            if unit not in seen:
                seen.add(unit)
                out.append(t)
        return out

    def _pieces(self) -> list[Tensor]:
        return [t.stack.fq if t.stack is not None else t.local_fq for t in self.heads()]


def _repoint(targets: list[_Target], full: Tensor) -> None:
    """Make each stack's and lone target's dequantized weight a view of ``full`` (their concatenation) and drop their
    own tensors; the targets of a stack keep their rows of it (``_StackStraightThrough`` splits it)."""
    rows, done = full.view(-1, full.shape[-1]), set()
    start = 0
    for t in targets:
        unit = t.stack if t.stack is not None else t
        if id(unit) in done:
            continue
        done.add(id(unit))
        n = (unit.fq if t.stack is not None else t.local_fq).shape[0]
        view = rows[start:start + n]
        start += n
        if t.stack is not None:
            t.stack.fq = view
            for x, part in zip(t.stack.targets, view.split(t.stack.rows), strict=True):
                x.local_fq = part
        else:
            t.local_fq = view


class _StackStraightThrough(torch.autograd.Function):
    """Forward: the rows of the stacked fake-quant weights split per master (one op, views); backward: each view's
    gradient to its master as is (straight-through, as ``fake_quant.straight_through`` per weight)."""

    @staticmethod
    def forward(ctx, stack: Tensor, rows: list[int], *_masters: Tensor) -> tuple[Tensor, ...]:  # noqa: ARG004
        return stack.split(rows)  # the masters are inputs only so that backward reaches them

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        return (None, None, *grads)


@dataclasses.dataclass(eq=False)
class _Stack:
    """Targets refreshed by one quantizer call over their stacked weights: the same projection of the local experts
    of one layer, each as its whole Hugging Face tensors' rows (gate_proj over up_proj for fc1). Split over
    expert-tensor-parallel ranks (ETP > 1: EP 1, TP > 1), the concatenation of this rank's shards is all-gathered
    once per stack and laid out as those rows (``_gather_stack``), as the lone path's gather and ``shards_to_hf`` do
    per target. Their rows are quantized independently under every scheme (W4A16 groups and INT8 scales along a
    row over the whole K, FP8 blocks of B rows, so each tensor's rows must be whole blocks), so the stack's codes,
    scales and dequantized weights are those of each weight alone, bit for bit; ``fq`` is this rank's shards of
    them (``_local_rows``: ``hf_to_shard`` of each target)."""

    name: str
    targets: list[_Target]
    qw: QuantizedWeight | None = None  # the stack's codes and scales, whole tensors (sliced per weight for the sync)
    fq: Tensor | None = None  # this rank's shards of the dequantized weights (the masters stacked), their dtype
    finite: Tensor | None = None  # 0-dim bool on the device: every scale of the stack finite
    st: dict[bool, tuple[Tensor, ...]] = dataclasses.field(default_factory=dict)  # grad mode -> each target's weight

    @property
    def rows(self) -> list[int]:
        """Each master's rows (of ``fq``)."""
        return [t.shape[0] for t in self.targets]

    @property
    def hf_rows(self) -> list[int]:
        """Each target's rows of ``qw``: its Hugging Face tensors' together."""
        return [_hf_rows(t) for t in self.targets]


def _hf_rows(t: _Target) -> int:
    """Rows of ``t``'s Hugging Face tensors together (gate_proj and up_proj for fc1): its master's, times the
    expert-TP size where that splits rows (fc1; fc2 is split along K)."""
    return t.shape[0] * (t.size if t.group is not None and not t.splits_k else 1)


def _stacks(targets: list[_Target], cfg: QuantConfig) -> list[_Stack]:
    """The experts' targets of each layer and projection (fc1, fc2), in stacks of at most GROUP_BYTES (fp32, of the
    gathered weights) that one quantizer call refreshes; FP8 only where every Hugging Face tensor is whole blocks of
    rows (a block must not straddle two weights). The rest refresh alone (all of them without STACK_EXPERTS)."""
    block = cfg.group_size if cfg.scheme == "w8a8_fp8" else 1
    by_key: dict[str, list[_Target]] = {}
    for t in targets:
        if STACK_EXPERTS and t.pm.split in ("fc1", "fc2") and _hf_rows(t) // len(t.pm.hf) % block == 0:
            layer = t.pm.mcore.split(".mlp.experts.")[0]
            by_key.setdefault(f"{layer}.mlp.experts.{t.pm.split}", []).append(t)
    stacks = []
    for key, group in by_key.items():
        chunk: list[_Target] = []
        size, budget = 0, GROUP_BYTES.get(group[0].param.device.type, GROUP_BYTES["cuda"])
        for t in group:  # the same shapes on every expert-TP rank: the same stacks, so the same all_gathers
            numel = t.shape.numel()
            if chunk and size + 4 * numel * t.size > budget:
                stacks.append(_Stack(f"{key} ({len(chunk)} experts)", chunk))
                chunk, size = [], 0
            chunk.append(t)
            size += 4 * numel * t.size
        stacks.append(_Stack(f"{key} ({len(chunk)} experts)", chunk))
    for s in stacks:
        for i, t in enumerate(s.targets):
            t.stack, t.index = s, i
    return stacks


def _gather_stack(s: _Stack) -> Tensor:
    """The stack's weights as their whole Hugging Face tensors' rows, in target order (no autograd). At ETP > 1 the
    concatenation of this rank's shards is all-gathered once; as ``shards_to_hf`` per target: fc1's rows
    [rank][expert][gate | up][rows / ETP] are laid out [expert][gate | up][rank][rows / ETP], fc2's ranks are put
    side by side along K."""
    t0 = s.targets[0]
    local = _stacked_masters(s.targets)
    if t0.group is None:
        return local
    parts = all_gather_tensors(to_group_device(local, t0.group), t0.group, t0.size, name=s.name)
    if t0.splits_k:
        return torch.cat(parts, dim=1)
    k = local.shape[1]
    tensors = len(t0.pm.hf) * len(s.targets)
    return torch.stack(parts).view(t0.size, tensors, -1, k).transpose(0, 1).reshape(-1, k)


def _stacked_masters(targets: list[_Target]) -> Tensor:
    """The targets' master weights one over the other: a view where they are consecutive experts of one grouped
    parameter, else a concatenation."""
    t0 = targets[0]
    if len(targets) == 1:
        return t0.master
    experts = [t.expert for t in targets]
    if t0.expert is not None and all(t.param is t0.param for t in targets) and \
            experts == list(range(t0.expert, t0.expert + len(targets))):
        return t0.param[t0.expert: t0.expert + len(targets)].flatten(0, 1)
    return torch.cat([t.master for t in targets])


def _local_rows(s: _Stack, full: Tensor) -> Tensor:
    """This rank's shards of the stack's whole rows ``full`` (``_gather_stack``'s layout), concatenated as the masters
    are: ``hf_to_shard`` of each target, in one op (a copy where ETP > 1)."""
    t0 = s.targets[0]
    if t0.group is None:
        return full
    if t0.splits_k:
        return full.chunk(t0.size, dim=1)[t0.rank].contiguous()
    k = full.shape[1]
    return full.view(len(t0.pm.hf) * len(s.targets), t0.size, -1, k)[:, t0.rank].reshape(-1, k)


def _weight_quantizer(module: torch.nn.Module, param_name: str):
    """The TensorQuantizer ModelOpt applies to ``module.<param_name>``: ``weight_quantizer`` for a linear's
    ``weight``, ``weight_quantizer[i]`` for TE grouped linears' ``weight{i}`` (ModelOpt's GroupedQuantizer)."""
    wq = module.weight_quantizer
    if param_name == "weight":
        return wq
    index = param_name.removeprefix("weight")
    if not index.isdigit():
        raise ValueError(f"{param_name}: not a linear weight ModelOpt quantizes")
    return wq[int(index)]


def resolve_refresh_kernel(choice: str, device: torch.device, compiled: bool = False) -> str:
    """``learner.refresh_kernel`` for weights on ``device``: "triton" or "torch". ``auto`` is Triton on CUDA (a CUDA
    build of torch) where it imports and ``compiled`` (learner.compile_quantizer) is off. ``triton`` is refused,
    naming the key, where Triton is not installed, or on CPU weights without its interpreter (TRITON_INTERPRET=1)."""
    if choice not in REFRESH_KERNELS:
        raise ValueError(f"learner.refresh_kernel: {choice!r} is not one of {list(REFRESH_KERNELS)}")
    has_triton = importlib.util.find_spec("triton") is not None
    if choice == "auto":
        # a CUDA build of torch: the simulated device (gpu/simulated_device.py) reports "cuda" on a CPU build, where
        # the refresh runs torch's ops (qarl plan --simulate then counts the torch path's temporaries: an upper bound)
        cuda = device.type == "cuda" and torch.version.cuda is not None
        return "triton" if cuda and has_triton and not compiled else "torch"
    if choice == "torch":
        return "torch"
    if not has_triton:
        raise ValueError("learner.refresh_kernel: triton is not installed in the learner's environment "
                         "(it ships with CUDA builds of torch); use auto or torch")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError("learner.refresh_kernel: triton on a CPU learner runs only under Triton's interpreter "
                         "(TRITON_INTERPRET=1, a test mode); the CPU's path is torch (or auto)")
    return "triton"


def _check_group_divides_k(targets: list[_Target], cfg: QuantConfig) -> None:
    """W4A16's group must divide every quantized weight's K (the Hugging Face tensor's): refused when the learner is
    built, not at its first forward."""
    if cfg.scheme != "w4a16":
        return
    for t in targets:
        k = t.shape[1] * (t.size if t.splits_k else 1)
        if k % cfg.group_size:
            raise ValueError(f"quant.group_size: {cfg.group_size} does not divide K={k} of {t.pm.hf[0]} "
                             "(W4A16 quantizes groups of that many along K)")


def _device_failure(err: BaseException) -> bool:
    """An error the torch path would meet too (out of memory, a CUDA error that poisons the context): raised, not
    answered by falling back from the Triton refresh."""
    kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None), getattr(torch, "AcceleratorError", None)) if k)
    return isinstance(err, kinds) or "CUDA error" in str(err)


class FakeQuant:
    """The ModelOpt quantizers of one rank's model, bound to the one quantizer; ``remove()`` disables them."""

    def __init__(self, model: torch.nn.Module, arch: Qwen3MoeArch, cfg: QuantConfig, layout: Layout | None = None,
                 forward: bool = True, compiled: bool = False, refresh_kernel: str = "auto"):
        import modelopt.torch.quantization as mtq

        if not cfg.enabled:
            raise ValueError("quant.scheme is bf16: there is nothing to fake-quantize")
        register_backends()
        self.arch, self.cfg, self.compiled = arch, cfg, compiled
        self.layout = layout or Layout.current()
        fp8 = getattr(getattr(model, "config", None), "fp8", None)  # Megatron runs the TE layers in fp8 autocast
        chosen = self._chosen(model_impl(model))
        with _sequential_mlp_as_children(model, self.layout), _convert_only(model, {m for _, m, _ in chosen}, fp8):
            mtq.quantize(model, modelopt_config(cfg), forward_loop=None)
        self.targets = [self._target(model, pm, module_name, param_name) for pm, module_name, param_name in chosen]
        _check_group_divides_k(self.targets, cfg)
        self.stacks = _stacks(self.targets, cfg)
        self.grouped = self._bind_grouped()
        device = self.targets[0].param.device if self.targets else torch.device("cpu")
        self.kernel_choice = refresh_kernel
        self.kernel = resolve_refresh_kernel(refresh_kernel, device, compiled)
        bound_modules = {t.module for t in self.targets}
        for name, module in model.named_modules():  # converted linears the config leaves in high precision
            if hasattr(module, "weight_quantizer") and module not in bound_modules:
                if fp8:
                    raise ValueError(f"model.te_fp8: ModelOpt converted {name} ({type(module).__name__}), which "
                                     f"quant.scheme={cfg.scheme!r} does not quantize, and its forward refuses TE's "
                                     "fp8 autocast")
                self._quantizers_of(module, on=False)
        if fp8:  # the quantized GEMMs compute on the fake-quant operands in high precision, outside TE's FP8
            for module in bound_modules:
                _outside_fp8_autocast(module)
        if not forward:  # quantize for export only (a BF16 learner feeding a low-bit rollout)
            self.remove()

    def _chosen(self, impl: str) -> list[tuple[ParamMap, str, str]]:
        """(parameter map, Megatron module name, parameter name) of every linear weight ``cfg`` quantizes."""
        lay, out = self.layout, []
        for pm in param_maps(self.arch, lay.ep_rank, lay.ep, impl=impl):
            if pm.split not in _LINEAR_SPLITS:
                continue
            chosen = [is_quantized(n.removesuffix(".weight"), self.cfg) for n in pm.hf]
            if not any(chosen):
                continue
            if not all(chosen):
                raise ValueError(f"quant.ignore: {pm.hf} share Megatron's {pm.mcore}; quantize all or none")
            out.append((pm, *pm.mcore.rsplit(".", 1)))
        return out

    def _target(self, model: torch.nn.Module, pm: ParamMap, module_name: str, param_name: str) -> _Target:
        """The converted module of one chosen weight, its quantizers bound to the one quantizer."""
        from megatron.core import parallel_state as ps

        lay = self.layout
        if pm.split in ("fc1", "fc2"):
            group, size, rank = ps.get_expert_tensor_parallel_group(), lay.etp, lay.etp_rank
        else:
            group, size, rank = ps.get_tensor_model_parallel_group(), lay.tp, lay.tp_rank
        module = model.get_submodule(module_name)
        if not hasattr(module, "weight_quantizer"):
            raise TypeError(f"{module_name} ({type(module).__name__}): ModelOpt inserted no quantizer "
                            "(not a linear its Megatron plugin knows)")
        target = _Target(pm, module, getattr(module, param_name), _weight_quantizer(module, param_name),
                         module.input_quantizer, group if size > 1 else None, size, rank, _LINEAR_SPLITS[pm.split],
                         expert=pm.expert if pm.stacked else None)
        _BOUND[target.weight_quantizer] = self._weight_fn(target)
        _BOUND[target.input_quantizer] = self._act_fn(target)
        return target

    def _bind_grouped(self) -> list[_GroupedWeight]:
        """The weight quantizer of each grouped expert linear (one for all its experts' targets) bound to their
        stacked weight (``_GroupedWeight``)."""
        by_module: dict[int, list[_Target]] = {}
        for t in self.targets:
            if t.expert is not None:
                by_module.setdefault(id(t.module), []).append(t)
        out = []
        for targets in by_module.values():
            g = _GroupedWeight(targets[0].param, sorted(targets, key=lambda t: t.expert))
            _BOUND[targets[0].weight_quantizer] = self._grouped_fn(g)
            out.append(g)
        return out

    def _grouped_fn(self, g: _GroupedWeight) -> Callable[[Tensor], Tensor]:
        def fake_quant(w: Tensor) -> Tensor:
            for t in g.heads():  # one target of each stack (and each lone one) refreshes its unit
                self._refresh(t)
            if w is not g.param:
                return straight_through(w, g.weight().detach().to(w.dtype))
            return g.weight()

        return fake_quant

    @staticmethod
    def _quantizers_of(module: torch.nn.Module, on: bool) -> None:
        for name in ("weight_quantizer", "input_quantizer"):
            quantizers = getattr(module, name)
            for q in (quantizers if isinstance(quantizers, torch.nn.ModuleList) else [quantizers]):
                q.enable() if on else q.disable()

    # ------------------------------------------------------------------ quantization, cached per version
    def _refresh(self, t: _Target) -> None:
        """Quantize ``t`` (with its stack) when its master changed since: no host sync (a nan / inf in a weight
        makes its scales, its fake-quant weight and so the step's gradients non-finite, and Megatron's optimizer
        skips such a step; the weight sync refuses it by name, ``target_codes``)."""
        version = t.version_key()
        if t.version == version and t.local_fq is not None:
            return
        if t.stack is not None:
            self._refresh_stack(t.stack)
            return
        with torch.no_grad():
            w = t.master.detach()
            shards = ([w] if t.group is None else
                      all_gather_tensors(to_group_device(w, t.group), t.group, t.size, name=t.pm.mcore))
            hf = shards_to_hf(t.pm, shards, self.arch)
            pairs = {name: self._fake_quantize(tensor, name) for name, tensor in hf.items()}
            t.quantized = {name: qw for name, (qw, _) in pairs.items()}
            flags = [scales_finite(qw) for qw in t.quantized.values()]
            t.finite = flags[0] if len(flags) == 1 else torch.stack(flags).all()
            # a copy of this rank's shard: hf_to_shard may return a view of the whole gathered tensor (the fused
            # qkv's TP chunk), which would keep every TP rank's bf16 weights alive in the cache (docs/plan.md)
            local = hf_to_shard(t.pm, lambda name: pairs[name][1], self.arch, self.layout)
            t.local_fq = (local.clone(memory_format=torch.contiguous_format) if local.dtype == w.dtype
                          else local.to(w.dtype).contiguous())  # .to another dtype copies
        t.version, t.st = version, {}

    def _refresh_stack(self, s: _Stack) -> None:
        """One quantizer call over the stack's whole weights (``_gather_stack``: rows concatenated, one all_gather at
        ETP > 1); each target's dequantized weight is its rows of this rank's shards (a view), its codes are sliced
        when the sync asks (``target_codes``)."""
        with torch.no_grad():  # under no_grad: no detach (one op each)
            s.qw, full = self._fake_quantize(_gather_stack(s), s.name)
            s.fq = _local_rows(s, full)
            s.finite, s.st = scales_finite(s.qw), {}
            for t, part in zip(s.targets, s.fq.split(s.rows), strict=True):
                t.local_fq, t.quantized, t.st = part, None, {}
                t.version = t.version_key()

    def _fake_quantize(self, w: Tensor, name: str) -> tuple[QuantizedWeight, Tensor]:
        """(codes and scales, dequantized weight in ``w``'s dtype) of ``w``, with no host sync, by the refresh kernel
        (``learner.refresh_kernel``; the same bits either way). Where ``auto`` chose Triton and its kernel fails
        (a GPU its compiler does not support), the refresh runs the torch ops from then on, after one warning."""
        if self.kernel == "triton":
            try:
                from megatron_qarl.qat.triton_refresh import fake_quantize_triton

                return fake_quantize_triton(w, self.cfg, name)
            except Exception as err:  # noqa: BLE001 - auto only: the torch path computes the same bits
                if self.kernel_choice != "auto" or _device_failure(err):
                    raise
                self.kernel = "torch"
                warnings.warn(f"learner.refresh_kernel: the Triton refresh failed on {name} ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200] if str(err) else ''}); it runs the torch ops (same "
                              "bits). Set learner.refresh_kernel=torch to silence this", stacklevel=2)
        return fake_quantize_weight(w, self.cfg, name, self.compiled, check_finite=False)

    def invalidate(self) -> None:
        """Forget every cached quantization (after weights change behind autograd's back)."""
        for t in self.targets:
            t.version = t.quantized = t.local_fq = t.finite = None
            t.st = {}
        for s in self.stacks:
            s.qw = s.fq = s.finite = None
            s.st = {}
        for g in self.grouped:
            g.fq, g.key, g.st = None, (), {}

    def target_codes(self, t: _Target, checked: bool = False) -> dict[str, QuantizedWeight]:
        """Hugging Face name -> the QuantizedWeight of one target, as this rank's forward uses it (the very
        codes a weight sync sends; quantized once per optimizer step). ValueError naming the weight when it holds
        a nan / inf (a host read), unless ``checked`` (the sync read every rank's ``finite_flags`` at once)."""
        self._refresh(t)
        finite = t.stack.finite if t.stack is not None else t.finite
        # asked as "any non-finite?": the simulated device (qarl plan --simulate) answers False to a flag whose value
        # it does not know (gpu/simulated_device.py, _scalar_stand_in), i.e. nothing found
        if not checked and bool(torch.logical_not(finite)):
            where = t.stack.name if t.stack is not None else t.pm.mcore
            raise ValueError(f"{where}: non-finite value(s) (nan/inf) in the weight; its codes are not sent")
        if t.quantized is None:
            t.quantized = self._stack_codes(t)
        return t.quantized

    def _stack_codes(self, t: _Target) -> dict[str, QuantizedWeight]:
        """``t``'s Hugging Face tensors' codes and scales, whole (gathered at ETP > 1, as the lone path's): their rows
        of the stack's (gate_proj, up_proj: halves)."""
        s, cfg = t.stack, self.cfg
        start = sum(s.hf_rows[: t.index])
        rows = s.hf_rows[t.index] // len(t.pm.hf)
        per_scale_row = cfg.group_size if cfg.scheme == "w8a8_fp8" else 1
        zp, out = s.qw.zero_points, {}
        for i, name in enumerate(t.pm.hf):
            a, b = start + i * rows, start + (i + 1) * rows
            out[name] = QuantizedWeight(s.qw.codes[a:b], s.qw.scales[a // per_scale_row: b // per_scale_row],
                                        None if zp is None else zp[a:b], (rows, s.qw.shape[1]), s.qw.scheme,
                                        s.qw.group_size)
        return out

    def exact_weight(self, t: _Target) -> Tensor:
        """A target's dequantized codes as float32 with a straight-through gradient to its master weight: what a
        quantized linear multiplies in the learner's exact forward (moe/exact.py, ``numerics: exact``)."""
        self._refresh(t)
        master = t.master
        return straight_through(master, t.local_fq.to(master.dtype)).float()

    # ----------------------------------------------------------------------------- the backends' work
    def _weight_fn(self, t: _Target) -> Callable[[Tensor], Tensor]:
        def fake_quant(w: Tensor) -> Tensor:
            self._refresh(t)
            if w is not t.param:  # not the master itself: its own straight-through
                return straight_through(w, t.local_fq.to(w.dtype))
            return self._forward_weight(t)

        return fake_quant

    @staticmethod
    def _forward_weight(t: _Target) -> Tensor:
        """The weight ``t``'s linear multiplies: its fake-quant weight with a straight-through gradient to its master,
        made once per weight version and grad mode (for a stack, every target's at once: one op), then reused by
        every forward until the next refresh: the node saves nothing, so any number of backward passes go through
        it, each handing its gradient to the master."""
        mode = torch.is_grad_enabled()
        if t.stack is None:
            if mode not in t.st:
                t.st[mode] = straight_through(t.param, t.local_fq)
            return t.st[mode]
        s = t.stack
        if mode not in s.st:
            s.st[mode] = _StackStraightThrough.apply(s.fq, s.rows, *(x.param for x in s.targets))
        return s.st[mode][t.index]

    def _act_fn(self, t: _Target) -> Callable[[Tensor], Tensor]:
        def fake_quant(x: Tensor) -> Tensor:
            if not (t.splits_k and t.group is not None):
                return fake_quant_act(x, self.cfg)
            with torch.no_grad():  # per-token scales need the whole row: gather K, quantize, slice back
                x_local = to_group_device(x.detach(), t.group)
                full = torch.cat(all_gather_tensors(x_local, t.group, t.size, name=f"input of {t.pm.mcore}"), dim=-1)
                x_fq = fake_quant_act(full, self.cfg).chunk(t.size, dim=-1)[t.rank]
            return straight_through(x, x_fq.contiguous())

        return fake_quant

    def remove(self) -> None:
        """Disable the quantizers: the model computes with its master weights (the handle still exports)."""
        for t in self.targets:
            self._quantizers_of(t.module, on=False)


def finite_flags(fq: FakeQuant) -> list[tuple[str, Tensor]]:
    """(name, 0-dim bool "every scale finite") of each of ``fq``'s quantizer calls, stacks and lone targets, in one
    fixed order (the same on every rank), every target refreshed: what the weight sync agrees on before it sends
    (sync/payload.py, ``check_sendable``), with no host read here."""
    out, seen = [], set()
    for t in fq.targets:
        fq._refresh(t)  # noqa: SLF001 - this module's own class
        unit = t.stack if t.stack is not None else t
        if id(unit) not in seen:
            seen.add(id(unit))
            out.append((t.stack.name if t.stack is not None else t.pm.mcore, unit.finite))
    return out


def apply_fake_quant(model: torch.nn.Module, arch: Qwen3MoeArch, cfg: QuantConfig, forward: bool = True,
                     compiled: bool = False, refresh_kernel: str = "auto") -> FakeQuant:
    """Insert ModelOpt quantizers bound to the one quantizer into this rank's (unwrapped) Megatron model; returns
    the handle.

    ``forward=False`` leaves them disabled: the model computes in high precision while the handle still quantizes
    its weights for the rollout servers (unaligned quantized rollout, the baseline). ``compiled``: the per-step
    W4A16 refresh runs torch.compile'd (``qat.quantizer.fake_quantize_weight``); ``refresh_kernel``:
    learner.refresh_kernel (``resolve_refresh_kernel``)."""
    return FakeQuant(model, arch, cfg, forward=forward, compiled=compiled, refresh_kernel=refresh_kernel)
