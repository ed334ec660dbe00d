"""Every patch of Megatron-Core (and of the libraries it calls) in one place: the fixes Megatron-Core 0.16 needs to run
without CUDA (or without Transformer Engine), and the one it needs on every Linux machine (its checkpoint writer's
results-queue process, ``fix_write_results_queue``, which outlives a killed trainer with or without a GPU).

Each fix is a small function named ``fix_*`` whose docstring gives the reason, marked with the condition under which
the machine needs it (``@when(cuda_absent)``, ``@when(te_absent)``, ``@when(te_and_apex_absent)``,
``@when(linux)``): the condition of the failure
itself, so a GPU machine without Transformer Engine gets the Transformer Engine fix (and the Linux one) and nothing
else. A fix changes installed code only through ``_replace``, which records the attribute it replaced, so every fix
can be undone.

``apply()`` installs, once, the fixes this machine needs, all or none: if one fails, the ones installed before it are
undone and the error names the failing fix. ``remove()`` undoes them. Each fix has a test in
tests/test_megatron_cpu.py that reproduces the upstream failure without the fix, so the test fails (and the fix can
go) the day upstream no longer needs it. Installed packages are never edited: the fixes replace attributes at import
time. ``moe.model.build_model`` and ``moe.parallelize.init_parallel`` call ``apply()``, so every learner process,
on CPUs and GPUs, runs with the fixes its machine needs.

Things that need no patch, only the right arguments (see megatron_qarl.moe.model):
``use_cpu_initialization``, an explicit boolean causal mask, the *_fusion flags off,
SequentialMLP experts, ``model_parallel_cuda_manual_seed(..., inference_rng_tracker=True)``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

_MISSING = object()  # an attribute the owner did not define itself (inherited, or absent)
# the fixes in force, each with what it replaced: (owner, attribute, the owner's own value or _MISSING);
# None until apply() has run
_installed: dict[str, list[tuple[object, str, object]]] | None = None
_journal: list[tuple[object, str, object]] | None = None  # the replacements of the fix being installed


def cuda_absent() -> bool:
    """The running torch has no usable CUDA device (a CPU-only build, or no GPU visible)."""
    return not torch.cuda.is_available()


def te_absent() -> bool:
    """Megatron found no Transformer Engine (``moe_utils.HAVE_TE``: its ``import transformer_engine`` failed)."""
    from megatron.core.transformer.moe import moe_utils

    return not moe_utils.HAVE_TE


def te_and_apex_absent() -> bool:
    """Megatron found neither Transformer Engine nor Apex: clip_grads.py's ``import transformer_engine`` and
    ``import amp_C`` both failed, so it bound megatron.core.utils' local multi-tensor fallbacks (as did optimizer.py).
    Read from its ``multi_tensor_applier``, which no fix replaces (``fix_multi_tensor_fallbacks`` replaces the ops)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    return clip_grads.multi_tensor_applier is utils.local_multi_tensor_applier


def linux() -> bool:
    """The kernel has ``prctl(PR_SET_PDEATHSIG)``, which ``utils.parent_death.die_with_parent`` uses (Linux)."""
    return sys.platform.startswith("linux")


def when(condition: Callable[[], bool]) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Mark a fix with the condition under which the machine needs it."""

    def mark(fix: Callable[[], None]) -> Callable[[], None]:
        fix.condition = condition
        return fix

    return mark


def _replace(owner: object, name: str, value: object) -> None:
    """``owner.name = value``, recording the owner's own previous value so that the fix can be undone."""
    if _journal is None:
        raise RuntimeError(f"megatron_cpu: replacing {name}: fixes are installed by megatron_cpu.apply() only")
    _journal.append((owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, value)


def _undo(journal: list[tuple[object, str, object]]) -> None:
    for owner, name, old in reversed(journal):
        if old is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, old)


@when(cuda_absent)
def fix_current_device() -> None:
    """torch.cuda.current_device() is called inside forward passes (rotary embeddings, attention
    masks, the alltoall dispatcher's buffers) and raises "Torch not compiled with CUDA enabled".
    Returning the string "cpu" makes every ``device=torch.cuda.current_device()`` a CPU tensor."""
    _replace(torch.cuda, "current_device", lambda: "cpu")


@when(cuda_absent)
def fix_alltoall_streams() -> None:
    """The alltoall token dispatcher creates a torch.cuda.Stream in __init__ and moves its split
    sizes to the host on that stream; on CPU the split sizes also stay tensors, while
    torch.distributed.all_to_all_single wants host sizes (with EP > 1 it raises otherwise).
    Replace the device-to-host step with what it does on GPUs, minus the stream: the split sizes
    become numpy arrays (later code calls .tolist() on them)."""
    from megatron.core.transformer.moe import token_dispatcher as td

    cls = td.MoEAlltoAllTokenDispatcher
    _replace(cls, "cuda_dtoh_stream", "cpu")  # any non-None value: __init__ then skips torch.cuda.Stream()

    def _host(x):
        return x.numpy() if torch.is_tensor(x) else x

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            self.input_splits = _host(self.input_splits)
            self.output_splits = _host(self.output_splits)
            self.output_splits_tp = _host(self.output_splits_tp)
        return tokens_per_expert

    _replace(cls, "_maybe_dtoh_and_synchronize", _maybe_dtoh_and_synchronize)


@when(te_absent)
def fix_te_general_gemm() -> None:
    """megatron-core 0.14-0.16 bug without Transformer Engine (on CPUs and GPUs alike): moe_utils imports
    te_general_gemm only inside ``try: import transformer_engine`` and later tests ``te_general_gemm is not None``,
    so every MoE router forward raises NameError. Define the name as None."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        _replace(moe_utils, "te_general_gemm", None)


@when(te_absent)
def fix_te_min_version() -> None:
    """megatron-core 0.16 bug without Transformer Engine (on CPUs and GPUs alike): ``utils.is_te_min_version``
    compares ``get_te_version()``, None without TE, with a version, so ``OptimizerConfig`` with
    ``use_precision_aware_optimizer`` (our optimizer CPU offload, ``learner.offload_kwargs``) raises TypeError
    "'>=' not supported between instances of 'NoneType' and 'Version'". Without TE no minimum TE version is
    installed: answer False where the optimizer asks (optimizer_config and optimizer/__init__ import the name)."""
    from megatron.core import optimizer
    from megatron.core.optimizer import optimizer_config

    def is_te_min_version(*args, **kwargs):  # (version, check_equality=True)
        return False

    _replace(optimizer_config, "is_te_min_version", is_te_min_version)
    _replace(optimizer, "is_te_min_version", is_te_min_version)


class _CudaAllocationsOnCpu(torch.overrides.TorchFunctionMode):
    """Inside this mode, factory calls with device="cuda" allocate on the CPU, .cuda() is a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _allocate_on_cpu(fn):
    def wrapper(*args, **kwargs):
        with _CudaAllocationsOnCpu():
            return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper


@when(cuda_absent)
def fix_optimizer_device() -> None:
    """Megatron's optimizers allocate their loss-scale and found-inf tensors with device='cuda' in
    __init__, and gradient clipping / norm / zero counting allocate on 'cuda' too (clip_grads.py).
    Run exactly those methods in a torch-function mode that turns device='cuda' into 'cpu'. The mode
    is scoped to these calls: the forward and backward passes never pay for it."""
    from megatron.core.optimizer import optimizer as opt

    for cls, name in ((opt.FP32Optimizer, "__init__"), (opt.MixedPrecisionOptimizer, "__init__"),
                      (opt.MegatronOptimizer, "get_grad_norm"), (opt.MegatronOptimizer, "clip_grad_norm"),
                      (opt.MegatronOptimizer, "count_zeros"), (opt.ChainedOptimizer, "get_grad_norm"),
                      (opt.ChainedOptimizer, "count_zeros")):
        _replace(cls, name, _allocate_on_cpu(getattr(cls, name)))


@when(cuda_absent)
def fix_clip_grads() -> None:
    """clip_grad_by_total_norm_fp32 asserts every gradient is a 'torch.cuda.FloatTensor', so any
    clip_grad > 0 fails on CPU. Replace the name the optimizer module calls with the same rule,
    g <- g * max_norm / (total_norm + 1e-6) when that factor is below 1, for CPU tensors."""
    from megatron.core.optimizer import optimizer as opt

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        params = [parameters] if torch.is_tensor(parameters) else parameters
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff < 1.0:
            grads = [g.detach() for g in (getattr(p, attr, None) for p in params) if g is not None]
            if grads:
                torch._foreach_mul_(grads, coeff)

    _replace(opt, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm``: (||[||t_1||, ..., ||t_n||]||_2 as a float32 [1] tensor, the
    per-tensor norms or None), on the tensors' device. The per-tensor norms are one ``torch._foreach_norm`` (a
    constant number of kernels per dtype group on CUDA), their norm one more; nothing is read to the host."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    norms = torch._foreach_norm(tensors)
    if len({n.dtype for n in norms}) == 1:
        stacked = torch.stack(norms).float()
    else:  # mixed dtypes (never in Megatron's fp32 main grads): each norm as float32, in the tensors' order
        stacked = torch.stack([n.float() for n in norms])
    return torch.linalg.vector_norm(stacked).reshape(1), stacked if per_tensor else None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for ``amp_C.multi_tensor_scale``: dst_i <- src_i x scale (cast to dst_i's dtype), as
    ``torch._foreach_mul_`` when src and dst are the same tensors (clipping), ``torch._foreach_copy_`` otherwise."""
    src, dst = tensor_lists
    if len(src) != len(dst):
        raise ValueError(f"multi_tensor_scale: {len(src)} sources, {len(dst)} destinations")
    if not src:
        return
    if all(a is b for a, b in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


@when(te_and_apex_absent)
def fix_multi_tensor_fallbacks() -> None:
    """Without Transformer Engine and Apex (on CPUs and on GPUs alike) Megatron's clip_grads.py and optimizer.py
    bind megatron.core.utils' local stand-ins for the fused multi-tensor kernels. Its ``local_multi_tensor_l2_norm``
    builds ``torch.tensor([torch.norm(t) for t in tensors])``, which reads every tensor's norm to the host one at a
    time (inside torch.tensor's conversion, which no dispatch-mode count sees), then ``float()`` of their norm once
    more, so the grad norm of a train step reads the host once per gradient, a number that grows with the experts;
    ``local_multi_tensor_scale`` launches two kernels per tensor. Bind ``foreach_l2_norm`` and
    ``foreach_scale`` instead: the same values (bit for bit on CPU, where ``_foreach_norm`` is the per-tensor norm;
    to float32 rounding of the summation order on CUDA), no host read."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as opt

    _replace(clip_grads, "l2_norm_impl", foreach_l2_norm)
    _replace(clip_grads, "multi_tensor_scale_impl", foreach_scale)
    _replace(opt, "multi_tensor_scale_impl", foreach_scale)


def _fuse_groups(adam) -> int:
    """Set torch's fused Adam in the param groups of ``adam`` whose parameters all sit on a device torch has the
    fused kernel for, with each existing step counter where that kernel reads it (float32, the parameter's device);
    returns how many groups it set."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices, n = set(_get_fused_kernels_supported_devices()), 0
    for group in adam.param_groups:
        params = group["params"]
        if params and all(p.device.type in devices and p.is_floating_point() for p in params) and \
                not group.get("differentiable"):
            group["fused"], group["foreach"] = True, False
            for p in params:
                state = adam.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
            n += 1
    return n


def adam_step(value: float, group: dict, param: torch.Tensor) -> torch.Tensor:
    """An Adam step counter as torch keeps it for ``group``: float32 on the parameter's device where the group is
    fused or capturable (the kernel reads it there), a CPU tensor otherwise."""
    on_device = bool(group.get("fused") or group.get("capturable"))
    return torch.tensor(float(value), dtype=torch.float32, device=param.device if on_device else "cpu")


def use_fused_adam(optimizer) -> int:
    """Turn on torch's fused Adam / AdamW in the torch optimizers inside a Megatron optimizer (chained or not) that
    have taken no step yet (state is made lazily at the first one, the step counter on the parameters' device), and
    keep it on across loads: a checkpoint's param groups replace the live ones in ``load_state_dict`` (Megatron's
    and torch's), ``fused`` included, so a checkpoint written without it would turn it off; a load hook sets it
    again. Returns how many param groups it set."""
    n = 0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or inner.state:
            continue
        n += _fuse_groups(inner)
        inner.register_load_state_dict_post_hook(_fuse_groups)
    return n


@when(te_and_apex_absent)
def fix_torch_adam() -> None:
    """Without Transformer Engine and Apex Megatron's Adam is ``torch.optim.AdamW`` built with neither ``foreach``
    nor ``fused`` (optimizer/__init__.py: ``adam_cls(**kwargs)``). torch then runs its foreach path on CUDA and its
    for-loop on CPU, and both read every parameter's step counter to the host (``_get_value(step)``, a CPU tensor):
    a train step's host reads grow with the number of parameters, so with the experts (tests/test_learner_launches.py:
    a tiny-model train step read the host 52 times at 8 experts and 148 at 32 before this fix and
    ``fix_multi_tensor_fallbacks``, 2 after). Build Megatron's optimizers as before, then turn on
    torch's fused AdamW (``use_fused_adam``; a fused kernel for CUDA and CPU parameters alike): one kernel per device
    and dtype group, its step counter a device tensor, no host read. Its update equals the for-loop's to a few ulps
    of each parameter (tests/test_megatron_cpu.py), and it is the same for every element wherever it sits in a tensor,
    so sharded and whole parameters still get the same bits."""
    from megatron.core import optimizer as mopt

    build = mopt._get_megatron_optimizer_based_on_param_groups

    def _get_megatron_optimizer_based_on_param_groups(*args, **kwargs):
        optimizer = build(*args, **kwargs)
        use_fused_adam(optimizer)
        return optimizer

    _get_megatron_optimizer_based_on_param_groups.__wrapped__ = build
    _replace(mopt, "_get_megatron_optimizer_based_on_param_groups", _get_megatron_optimizer_based_on_param_groups)


@when(te_and_apex_absent)
def fix_reshardable_adam_step() -> None:
    """Without Transformer Engine and Apex the distributed optimizer's Adam is torch's, which keeps a per-parameter
    'step' in its state (TE's FusedAdam keeps it in the param groups). Loading a fully_reshardable optimizer
    checkpoint (train.checkpoint.optimizer_format) then fails with KeyError 'step': ``load_state_dict`` first gives
    every state the groups' step, ``load_parameter_state_from_fully_reshardable`` leaves 'step' out of what it
    read ("Handle torch Adam 'step' state separately"), and ``_set_main_param_and_optimizer_states`` copies every key
    of the state from it. Copy the keys the checkpoint has (the step stays the groups', which learner.checkpoint's
    ``restore_adam_steps`` sets as torch's Adam keeps it)."""
    from megatron.core.optimizer import distrib_optimizer as do

    original = do.DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 and "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:
                step = state.pop("step")
                try:
                    return original(self, model_param, tensors)
                finally:
                    state["step"] = step
        return original(self, model_param, tensors)

    _set_main_param_and_optimizer_states.__wrapped__ = original
    _replace(do.DistributedOptimizer, "_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states)


@when(cuda_absent)
def fix_cuda_synchronize() -> None:
    """torch.cuda.synchronize() raises "Torch not compiled with CUDA enabled" without CUDA, and two savers call it
    unconditionally: dist_checkpointing's torch_dist writer after its host copies (filesystem_async.py,
    ``FileSystemWriterAsync.preload_tensors``: ``if non_blocking: torch.cuda.synchronize()``), so no checkpoint can
    be saved, and ModelOpt's Megatron plugin before it serializes a quant module's state (modelopt/torch/opt/plugins/
    megatron.py, ``_modelopt_get_extra_state``), so no learner with ModelOpt quantizers can be saved. Both look the
    function up at call time. Without CUDA there is no stream to wait for: make it a no-op."""
    _replace(torch.cuda, "synchronize", lambda device=None: None)


_writer_managers: list = []  # fix_write_results_queue's Managers, alive as long as their queues


@when(linux)
def fix_write_results_queue() -> None:
    """dist-checkpointing's async writer gets its results queue from a multiprocessing Manager
    (filesystem_async.py, ``_get_write_results_queue``: ``ctx.Manager().Queue()``), a server process started on the
    first save that outlives its parent: every ``kill -9`` of a trainer (or a preempted job) leaves one behind
    (~260 MB each, seen here), on a GPU machine as on a CPU one. Start that Manager with PR_SET_PDEATHSIG instead
    (``die_with_parent``), so it dies with the rank that started it."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from megatron_qarl.utils.parent_death import die_with_parent

    def _get_write_results_queue():
        if fa._results_queue is None:
            manager = SyncManager(ctx=mp.get_context("spawn"))
            manager.start(initializer=die_with_parent)
            _writer_managers.append(manager)  # kept alive with the queue (and its pid visible to tests)
            fa._results_queue = manager.Queue()
        return fa._results_queue

    _replace(fa, "_get_write_results_queue", _get_write_results_queue)


@when(cuda_absent)
def fix_distributed_optimizer_types() -> None:
    """Megatron's DistributedOptimizer sorts the parameters it shards by ``param.type()`` and accepts only
    'torch.cuda.FloatTensor', 'torch.cuda.HalfTensor' and 'torch.cuda.BFloat16Tensor' (distrib_optimizer.py,
    _build_model_and_main_param_groups: "TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor,
    ..."), so learner.distributed_optimizer cannot be built on CPU. Run its __init__ (which does all that
    sorting) in a torch-function mode where ``type()`` of a CPU tensor, called without arguments, reports the
    CUDA name of its dtype; nothing else changes, and the mode ends with __init__."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class _CpuTypesAsCuda(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.type and len(args) == 1 and not kwargs and not args[0].is_cuda:
                return "torch.cuda." + func(args[0]).rsplit(".", 1)[1]
            return func(*args, **kwargs)

    init = DistributedOptimizer.__init__

    def __init__(self, *args, **kwargs):
        with _CpuTypesAsCuda():
            init(self, *args, **kwargs)

    __init__.__wrapped__ = init
    _replace(DistributedOptimizer, "__init__", __init__)


@when(cuda_absent)
def fix_recompute_rng() -> None:
    """Activation recompute (learner.recompute: Megatron's tensor_parallel.checkpoint, used by both full and
    selective recompute) saves the CUDA generator's state before the forward and restores it around the
    recomputation, through tensor_parallel.random's _get_cuda_rng_state / _set_cuda_rng_state, which call
    torch.cuda.random.get_rng_state and raise "Torch not compiled with CUDA enabled". Without CUDA there is no
    CUDA generator: the CPU generator and the tracker's states, which the same code saves and restores beside
    it, are all there is. Make the two CUDA-generator calls save nothing and restore nothing."""
    from megatron.core.tensor_parallel import random as mrandom

    _replace(mrandom, "_get_cuda_rng_state", lambda *args, **kwargs: None)
    _replace(mrandom, "_set_cuda_rng_state", lambda *args, **kwargs: None)


class RMSNorm(torch.nn.RMSNorm):
    """Fix by replacement (used in megatron_qarl.moe.model.layer_spec, on CPU and on GPUs without
    Transformer Engine): Megatron's WrappedTorchNorm, the only norm without TE or apex, asserts
    ``not sequence_parallel``, but MoE with TP > 1 requires sequence parallel.

    Its weight is replicated over the tensor-parallel group; with sequence parallel each rank sees
    other tokens, and q/k norms see other heads, so the weight is tagged ``sequence_parallel`` and
    Megatron's finalize_model_grads all-reduces its gradient over the tensor-parallel group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Hugging Face's Qwen3RMSNorm: normalise in fp32, cast back, then scale
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


FIXES = (fix_current_device, fix_alltoall_streams, fix_te_general_gemm, fix_te_min_version, fix_optimizer_device,
         fix_clip_grads, fix_multi_tensor_fallbacks, fix_torch_adam, fix_reshardable_adam_step, fix_cuda_synchronize,
         fix_distributed_optimizer_types, fix_recompute_rng,
         fix_write_results_queue)


def needed_fixes() -> list[Callable[[], None]]:
    """The fixes of FIXES whose condition holds on this machine, in FIXES order."""
    missing = [f.__name__ for f in FIXES if not callable(getattr(f, "condition", None))]
    if missing:
        raise TypeError(f"megatron_cpu: {', '.join(missing)} declare no condition (mark them with @when(...))")
    return [f for f in FIXES if f.condition()]


def apply() -> list[str]:
    """Install, once, every fix this machine needs; return the names of the fixes in force. All or none: when a fix
    fails, the fixes installed before it are undone and RuntimeError names the failing one (apply() may run again)."""
    global _installed, _journal
    if _installed is not None:
        return list(_installed)
    installed: dict[str, list[tuple[object, str, object]]] = {}
    for fix in needed_fixes():
        _journal = []
        try:
            fix()
        except Exception as err:
            _undo(_journal)
            for journal in reversed(list(installed.values())):
                _undo(journal)
            raise RuntimeError(f"megatron_cpu: {fix.__name__} failed ({type(err).__name__}: {err}); the "
                               f"{len(installed)} fixes installed before it ({', '.join(installed) or 'none'}) were "
                               "undone, so none is in force") from err
        finally:
            journal, _journal = _journal, None
        installed[fix.__name__] = journal
    _installed = installed
    return list(installed)


def remove() -> None:
    """Undo every installed fix (latest first); a later apply() installs them anew."""
    global _installed
    for journal in reversed(list((_installed or {}).values())):
        _undo(journal)
    _installed = None
