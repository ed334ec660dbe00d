"""A simulated CUDA device on CPU-only torch: run the learner's GPU code paths here, where a CPU tensor mixed into
device arithmetic fails as it does on a GPU.

``with simulated_cuda():`` makes this process look like a one-GPU machine to the code it runs:

- **The device.** ``torch.empty(..., device="cuda")``, ``device=torch.cuda.current_device()``, ``t.to("cuda")``,
  ``t.cuda()`` and ``with torch.device("cuda")`` give a ``SimTensor``: a tensor that reports ``cuda:0`` to Python
  (``.device``, ``.is_cuda``, ``.type()`` = ``torch.cuda.FloatTensor``, ...) and holds a real CPU tensor. Every
  aten op on it runs on that CPU tensor, in one ``TorchDispatchMode``, which first checks devices as CUDA does: an op
  that mixes a device tensor with a CPU tensor of one or more dimensions raises ``RuntimeError("Expected all tensors
  to be on the same device ...")`` naming the op. As on CUDA, 0-dim CPU tensors pass (they are scalars), so do
  copies between devices (``.to``, ``copy_``) and indexing with CPU indices. ``.numpy()`` of a device tensor raises.
  To autograd (C++) a SimTensor is a "meta" tensor, whose device guard exists in every torch build, so forward and
  backward run (a fake "cuda" tensor aborts the process in autograd on a CPU-only build).
- **The CUDA runtime.** ``torch.cuda.is_available()`` is True, one device; ``current_device``, ``set_device``,
  ``synchronize``, ``Stream``, ``Event``, ``current_stream``, ``stream``, ``get_device_capability`` (9, 0: Hopper),
  the RNG and memory-statistics calls get stand-ins (``CUDA_STANDINS``), installed only where CUDA is absent and
  undone on exit.
- **Megatron's CUDA paths.** ``megatron_cpu``'s fixes keyed on CUDA's absence are removed for the duration (the
  machine now "has" CUDA), so Megatron runs its GPU code: parameters allocated on the current device
  (``use_cpu_initialization`` False), the optimizers' device tensors, ``clip_grad_by_total_norm_fp32``'s
  ``torch.cuda.FloatTensor`` check, the alltoall dispatcher's device-to-host stream, the checkpoint writer's
  non-blocking copies and synchronize. Fixes keyed on other conditions (no Transformer Engine) stay.

- **Attention**: ``F.scaled_dot_product_attention`` runs the kernel a GPU would pick (shape-only: CUDA's flash
  kernel through its meta function, ``_flash_attention``) or the CPU run's (real values: torch's CPU flash kernel,
  ``_cpu_flash_attention``), not the math kernel torch picks for a "meta" tensor.
- **Shape-only backing** (``simulated_cuda(shapes_only=True)``, for ``plan.simulate``): device tensors hold meta
  tensors (shape, dtype, strides; no memory) instead of CPU ones, except small ones (up to ``SMALL_BYTES``) made
  by factories or copied from the host, which keep real values; ``_run_shapes`` runs each op on meta when any
  operand is meta, on the CPU otherwise, and stands in for the data-dependent steps (balanced top-k routing,
  ``masked_select`` / boolean indexing by a real mask, ``.item()`` of an unknown value, collectives without
  values; the grouped matmul's meta kernel, bf16 only, runs other dtypes as bf16 stand-ins). A ``tracker`` is told
  of every tensor the device holds.

Why this way and not another (each was tried on torch 2.13 CPU): the meta device runs backward but holds no values,
so every data-dependent step (``.item()``, ``nonzero``, Megatron's MoE dispatch: ``masked_select``,
``tokens_per_expert.tolist()``) needs a stand-in that changes what runs, and meta lets matmul and indexing with CPU
tensors through; FakeTensorMode on "cuda" aborts the process in autograd without a C++ device-guard extension, and
backward still fails with one; a CUDA build of torch has no CUDA runtime to call here. Here values are real, so
routing, the MoE dispatch, the loss, gradient norms and checkpoints are the real ones: nothing needs a stand-in and
nothing changes but the device check. What is not simulated: kernels (every op is the CPU one), streams and
asynchrony (a stand-in stream runs in order), NCCL (process groups are gloo, whose tensors live on the CPU:
``parallelize.group_device``), and memory (see qarl plan).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

DEVICE = torch.device("cuda", 0)  # what the simulated device reports to Python
_BACKING = torch.device("meta")  # what it is to C++ (autograd, the dispatcher)
_aten = torch.ops.aten

# ops that take tensors on different devices on CUDA too: copies between devices; a device tensor indexed with CPU
# indices (not a CPU tensor with device indices)
_COPY_OPS = {_aten._to_copy.default, _aten.copy_.default, _aten.copy.default, _aten.lift_fresh.default}
_INDEX_OPS = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default}
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class SimTensor(torch.Tensor):
    """A tensor on the simulated CUDA device: reports ``cuda:0`` to Python, is "meta" to C++, holds a CPU tensor
    (with ``simulated_cuda(shapes_only=True)``: a meta tensor where its values are not known, module docstring)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                  storage_offset=data.storage_offset(), dtype=data.dtype,
                                                  device=_BACKING, requires_grad=False)
        out._data = data
        return out

    @property
    def _data(self) -> torch.Tensor:
        return self.__dict__["_sim_data"]

    @_data.setter
    def _data(self, data: torch.Tensor) -> None:
        tracker, old = _STATE.tracker, self.__dict__.get("_sim_data")
        # a tensor whose backing is swapped (a meta buffer given real zeros before a collective, a real one turned
        # meta) stays what it was: its new storage keeps the old one's label (the QAT cache's codes stay qat_cache
        # when a weight sync gathers them, not the sync's comm_buffers)
        label = tracker.label_of(old) if tracker is not None and old is not None else None
        self.__dict__["_sim_data"] = data
        if tracker is not None:  # every tensor the device holds passes here: the allocation tracker's view
            tracker.add(data, label)

    def __repr__(self) -> str:
        return f"SimTensor({self._data!r}, device='{DEVICE}')"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        answer = _python_view(func, args, kwargs)
        if answer is not _NOT_HANDLED:
            return answer
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


class _State:
    """What the active ``simulated_cuda`` block asked for: shape-only backing, and the tracker told of every tensor."""

    shapes_only: bool = False
    tracker = None  # add(tensor, label), label_of(tensor), holders(tensor): plan.tracker.AllocationTracker


_STATE = _State()
_NOT_HANDLED = object()
_GETTERS = {"device": lambda t: DEVICE, "is_cuda": lambda t: True, "is_cpu": lambda t: False,
            "is_meta": lambda t: False}


def _python_view(func, args, kwargs):
    """What a CUDA tensor answers where a SimTensor's own answer would differ (its device, type, host access)."""
    self = args[0] if args else None
    if not isinstance(self, SimTensor):
        return _NOT_HANDLED
    for name, getter in _GETTERS.items():
        if func == getattr(torch.Tensor, name).__get__:
            return getter(self)
    if func == torch.Tensor.data.__set__:  # param.data = t: the wrapper's metadata and its CPU tensor change together
        value = args[1]
        if not isinstance(value, SimTensor):
            raise RuntimeError(f"simulated_cuda: setting .data of a {DEVICE} tensor to a {value.device} tensor")
        with torch._C.DisableTorchFunctionSubclass():
            func(self, value)
        self._data = value._data
        return None
    if func is torch.Tensor.type and len(args) == 1 and not kwargs:
        return "torch.cuda." + self._data.type().rsplit(".", 1)[1]
    if func is torch.Tensor.get_device:
        return DEVICE.index
    if func is torch.Tensor.data_ptr:
        if self._data.is_meta:  # no memory behind it: a stable, distinct address per storage and offset
            return self._data.untyped_storage()._cdata + self._data.storage_offset() * self._data.element_size()
        return self._data.data_ptr()
    if func in (torch.Tensor.tolist,):
        return _host(self._data).tolist()
    if func in (torch.Tensor.numpy, torch.Tensor.__array__):
        raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                        "to host memory first.")
    if func is torch.Tensor.untyped_storage:
        return self._data.untyped_storage()
    return _NOT_HANDLED


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # torch.cuda.current_device() is an index
        return True
    return torch.device(device).type == "cuda"


def _is_sim(device) -> bool:
    return device is not None and not isinstance(device, int) and torch.device(device) == _BACKING


_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor)


class _CudaArguments(TorchFunctionMode):
    """Turns CUDA devices in torch calls into the simulated device (C++'s "meta") before torch's argument parser
    would initialise CUDA: factory ``device=`` arguments, ``Tensor.to(cuda)``, ``Tensor.cuda()``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        answer = _python_view(func, args, kwargs)
        if answer is not _NOT_HANDLED:
            return answer
        if func is torch.Tensor.backward:
            return _backward(*args, **kwargs)
        if func is torch.autograd.backward:
            return _backward(*args, **{"gradient" if k == "grad_tensors" else k: v for k, v in kwargs.items()})
        if func is torch.nn.functional.scaled_dot_product_attention:
            answer = (_flash_attention if _STATE.shapes_only else _cpu_flash_attention)(*args, **kwargs)
            if answer is not _NOT_HANDLED:
                return answer
        if func is torch.Tensor.pin_memory:
            return args[0]  # host memory is host memory: there is no page-locking to do without a driver
        if func is torch.Tensor.cuda:
            return args[0].to(_BACKING, non_blocking=kwargs.get("non_blocking", False))
        if func is torch.Tensor.to:
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            if _is_cuda(device):
                kw = {"device": _BACKING, "non_blocking": non_blocking}
                if dtype is not None:
                    kw["dtype"] = dtype
                if memory_format is not None:
                    kw["memory_format"] = memory_format
                return func(args[0], **kw)
        if func in _FROM_DATA:
            # torch.tensor(data) reads and places its data in C++ beneath the dispatcher (no mode sees it): hand it
            # the values of device tensors, build it on the host, then place it
            on_self = func is torch.Tensor.new_tensor and isinstance(args[0], SimTensor) and "device" not in kwargs
            args = tuple(tree_map(lambda a: _host(a._data) if isinstance(a, SimTensor) else a, a) for a in args)
            to_device = on_self or _is_cuda(kwargs.get("device"))
            if to_device:
                kwargs["device"] = "cpu"
            out = func(*args, **kwargs)
            return SimTensor(out) if to_device else out
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _BACKING
        if kwargs.get("pin_memory"):  # page-locked host memory needs a driver: host memory is host memory here
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


_FLASH_OPS = {_aten._scaled_dot_product_flash_attention.default,
              _aten._scaled_dot_product_flash_attention_backward.default}
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """``F.scaled_dot_product_attention`` on the shape-only device as on a GPU: CUDA's flash kernel where a GPU's
    SDPA picks it (fp16 / bf16, no mask, no dropout, head dim <= 256 and a multiple of 8, grouped query heads
    native), through its meta kernel (``torch._meta_registrations``: the output and an fp32 log-sum-exp per head
    and query, which its backward reads with q, k, v; no s x s tensor). Elsewhere ``_NOT_HANDLED``: SDPA runs as
    torch dispatches it for a "meta" tensor, the math kernel, which is also what CUDA runs for those (a mask or fp32
    with grouped query heads rules out its flash and memory-efficient kernels)."""
    d = query.shape[-1]
    if (attn_mask is not None or dropout_p or query.dtype not in _FLASH_DTYPES or d > 256 or d % 8
            or (query.shape[-3] != key.shape[-3] and not enable_gqa)):
        return _NOT_HANDLED
    return _aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal, False, scale=scale)[0]


def _cpu_flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    """``F.scaled_dot_product_attention`` on the real-valued simulated device: the kernel the same call runs on CPU
    tensors (torch's CPU flash attention, ``_scaled_dot_product_flash_attention_for_cpu``, for float operands without
    dropout), so that the simulated run computes what the CPU run does bit for bit; torch would otherwise pick the
    math kernel for the "meta" tensor a SimTensor is to C++. ``_NOT_HANDLED`` elsewhere."""
    if dropout_p or query.dtype not in (torch.float32, torch.bfloat16, torch.float16) or (
            query.shape[-3] != key.shape[-3] and not enable_gqa):
        return _NOT_HANDLED
    return _aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, attn_mask=attn_mask,
                                                             scale=scale)[0]


def _backward(tensors, gradient=None, retain_graph=None, create_graph=False, inputs=None) -> None:
    """``Tensor.backward`` / ``torch.autograd.backward`` with ``_CudaArguments`` in force during the backward: torch
    takes a function mode off its stack while the mode handles a call, so a backward started from the handler would
    run without it, and a backward's own ``torch.empty(..., device=torch.cuda.current_device())`` (Megatron's
    sequence-parallel linear) would reach the real CUDA. The engine is called as torch.autograd.backward calls it."""
    from torch.autograd.graph import _engine_run_backward

    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grads = ((gradient,) if isinstance(gradient, torch.Tensor) else
             tuple(gradient) if gradient is not None else (None,) * len(tensors))
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    with _CudaArguments():
        grads = torch.autograd._make_grads(tensors, grads, is_grads_batched=False)
        _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                             inputs, allow_unreachable=True, accumulate_grad=True)


def _run(func, args, kwargs):
    """One aten op with simulated-device operands: the CUDA device check, then the op on the CPU tensors; results
    of an op that ran on the device are device tensors again (in-place results are their own input)."""
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    on_device = any(isinstance(t, SimTensor) for t in tensors) or _is_sim(kwargs.get("device"))
    if not on_device:
        return func(*args, **kwargs)
    if func not in _COPY_OPS:
        checked = tensors
        if func in _INDEX_OPS and isinstance(args[0], SimTensor):  # its indices (args[1]) may live on the CPU
            checked = [a for a in tree_leaves((args[0], args[2:], kwargs)) if isinstance(a, torch.Tensor)]
        host = [t for t in checked if not isinstance(t, SimTensor) and t.dim() > 0]
        if host:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{DEVICE} and cpu! ({func}: a CPU tensor of shape {list(host[0].shape)} among "
                               "simulated-CUDA operands)")
    if _STATE.shapes_only:
        return _run_shapes(func, args, kwargs)
    wrappers: dict[int, SimTensor] = {}

    collective = func.namespace == "c10d"

    def unwrap(a):
        if isinstance(a, SimTensor):
            wrappers[id(a._data)] = a
            if collective and a.dtype in _FLOAT8:  # NCCL moves float8; gloo refuses it: move the same bytes
                return a._data.view(torch.uint8)
            return a._data
        if isinstance(a, torch.device) and a == _BACKING:
            return torch.device("cpu")
        return a

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    if func is _aten._to_copy.default and kwargs.get("device") is not None and not _is_sim(kwargs["device"]):
        return out  # a copy to the host

    def wrap(o):
        if isinstance(o, torch.Tensor) and not isinstance(o, SimTensor):
            own = wrappers.get(id(o))
            return own if own is not None else SimTensor(o)
        return o

    return tree_map(wrap, out)


# ------------------------------------------------------------------------------- the shape-only backing
SMALL_BYTES = 1 << 24  # device tensors up to 16 MiB made by factories hold real values in shape-only mode
_FACTORIES = {"empty", "empty_strided", "zeros", "ones", "full", "arange", "scalar_tensor", "eye", "linspace", "rand",
              "randn", "randint", "randperm", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
              "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like"}
_MASKED = {_aten.masked_select.default}


def _host(data: torch.Tensor) -> torch.Tensor:
    """A device tensor's values on the host: its CPU tensor, or for a shape-only (meta) one a stand-in of zeros
    (``torch.empty`` beyond SMALL_BYTES: the pages are never touched unless written)."""
    if not data.is_meta:
        return data
    make = torch.zeros if data.numel() * data.element_size() <= SMALL_BYTES else torch.empty
    return make(data.shape, dtype=data.dtype)


def _to_meta(a):
    return a.to("meta") if isinstance(a, torch.Tensor) and not a.is_meta and a.dim() > 0 else a


def _meta_stand_in(a):
    """A meta tensor's CPU stand-in where an op needs values only for their shape (the *_like factories)."""
    return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype) if isinstance(a, torch.Tensor) and a.is_meta else a


def _scalar_stand_in(data: torch.Tensor):
    """``.item()`` of a tensor whose value is unknown: 0 of its type (False: no inf/nan found; 0.0 for a loss or a
    norm, which is finite). Only the learner's metrics and finiteness checks read such values."""
    return False if data.dtype == torch.bool else (0 if not data.dtype.is_floating_point else 0.0)


def _balanced_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The balanced MoE routing stand-in: row t picks experts (t*k + j) mod E, j < k, so every expert gets the mean
    number of tokens (exactly, when E divides rows * k): [rows, k] int64 with real values."""
    rows, experts = scores.shape
    return (torch.arange(rows * k, dtype=torch.int64) % experts).view(rows, k)


def _long_indices(indices):
    """Advanced indices with real boolean masks as the integer indices of their True positions (what indexing does
    with them), so that indexing a meta tensor knows its result's length."""
    out = []
    for ix in indices:
        data = ix._data if isinstance(ix, SimTensor) else ix
        if isinstance(data, torch.Tensor) and data.dtype == torch.bool and not data.is_meta:
            out += [SimTensor(i) if isinstance(ix, SimTensor) else i for i in data.nonzero().unbind(1)]
        else:
            out.append(ix)
    return out


def _collective_stand_in(func, args):
    """What a c10d op returns when it runs on tensors without values: its output arguments, unchanged (they keep
    their shapes), and a completed Work (torch's FakeWork)."""
    from torch._C._distributed_c10d import FakeWork

    out = []
    for r in func._schema.returns:
        out.append(FakeWork().boxed() if "Work" in str(r.type) else args[0])
    return out[0] if len(out) == 1 else tuple(out)


def _written(func) -> set[int]:
    """Positions of the arguments ``func`` writes into (in-place ops, out= variants)."""
    return {i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write}


def _run_shapes(func, args, kwargs):
    """One aten op on the shape-only backing. Device tensors are meta tensors (shape, dtype, strides: what memory
    needs) except small ones made by factories or copied from the host, which keep real values so that the
    integer bookkeeping of MoE dispatch (routing maps, token counts, split sizes) is exact. An op with a meta
    operand runs on meta (real operands it only reads are moved to meta for it; real ones it writes become meta);
    an op on real operands only runs on the CPU. Data-dependent results: ``masked_select`` takes its length from
    a real mask; ``topk`` of unknown scores returns real, balanced indices (``_balanced_topk``: the router's
    choice); ``.item()`` returns ``_scalar_stand_in``; a copy to the host, zeros. c10d collectives run on the
    stand-in process group of the other ranks (plan.simulate): a collective with real inputs gets real outputs."""
    leaves = [a for a in tree_leaves((args, kwargs)) if isinstance(a, SimTensor)]
    meta = any(a._data.is_meta for a in leaves) or func in _FLASH_OPS  # CUDA's flash kernel: no CPU one to run
    answer = _data_dependent(func, args, kwargs, meta)
    if answer is not _NOT_HANDLED:
        return answer
    if func.overloadpacket.__name__ in _FACTORIES:
        return _run_factory(func, args, kwargs)
    collective = func.namespace == "c10d"
    if collective:
        meta = _collective_operands(leaves)
        if meta:  # a large buffer among them: values unknown, outputs keep their shapes (no meta kernels for c10d)
            return _collective_stand_in(func, args)
    elif meta:
        _written_turn_meta(func, args, kwargs)
    return _run_on_backing(func, args, kwargs, meta=meta, collective=collective)


def _data_dependent(func, args, kwargs, meta: bool):
    """The stand-ins for ops whose result depends on values a meta operand does not have (``_run_shapes``):
    ``.item()``, a copy to the host, the router's top-k; ``_NOT_HANDLED`` for any other op."""
    if func is _aten._local_scalar_dense.default and meta:
        return _scalar_stand_in(args[0]._data)
    if func is _aten._to_copy.default and kwargs.get("device") is not None and not _is_sim(kwargs["device"]):
        src = args[0]._data
        host = _host(src) if src.is_meta else src
        return func(host, **{k: v for k, v in kwargs.items()})
    if func is _aten.topk.default and meta:
        values, _ = func(*tree_map(lambda a: a._data if isinstance(a, SimTensor) else a, args), **kwargs)
        k = args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        if args[0].dim() != 2 or dim not in (1, -1):
            raise RuntimeError(f"simulated_cuda(shapes_only): topk of unknown values over dim {dim} of a "
                               f"{args[0].dim()}-d tensor: only the router's [tokens, experts] has a stand-in")
        return SimTensor(values), SimTensor(_balanced_topk(args[0]._data, k))
    return _NOT_HANDLED


def _run_factory(func, args, kwargs) -> SimTensor:
    """A factory on the device: meta, or real values (zeros, arange, full, ...) when at most ``SMALL_BYTES``."""
    def unwrap_factory(a):
        if isinstance(a, SimTensor):
            return a._data
        if isinstance(a, torch.device) and a == _BACKING:
            return torch.device("meta")
        return a

    out = func(*tree_map(unwrap_factory, args), **tree_map(unwrap_factory, kwargs))
    if out.numel() * out.element_size() <= SMALL_BYTES:
        real = dict(kwargs, device=torch.device("cpu")) if "device" in kwargs else kwargs
        out = func(*tree_map(lambda a: _meta_stand_in(unwrap_factory(a)), args),
                   **tree_map(lambda a: _meta_stand_in(unwrap_factory(a)), real))
        if out.device.type != "cpu":
            out = out.to("cpu")
    return SimTensor(out)


def _shares_storage(data: torch.Tensor) -> bool:
    """Whether another tensor the allocation tracker counts holds ``data``'s storage too (a view of it)."""
    return _STATE.tracker is not None and _STATE.tracker.holders(data) > 1


def _collective_operands(leaves: list[SimTensor]) -> bool:
    """A collective's operands before it runs; True when any stays meta (its values are unknown). With a real input,
    the other ranks' answer is values: small meta buffers get real zeros; a large one, or a view of another
    tensor's storage (real zeros would be a second copy of it while the base lives on: the FP8 QAT cache's codes,
    a view of their blocked form, were counted twice after a weight sync gathered them), turns every operand meta."""
    if any(not a._data.is_meta for a in leaves):
        for a in leaves:
            if (a._data.is_meta and not _shares_storage(a._data)
                    and a._data.numel() * a._data.element_size() <= SMALL_BYTES):
                a._data = torch.zeros(a.shape, dtype=a.dtype)
    meta = any(a._data.is_meta for a in leaves)
    if meta:
        for a in leaves:
            if not a._data.is_meta:
                a._data = a._data.to("meta")
    return meta


def _written_turn_meta(func, args, kwargs) -> None:
    """Real operands an op with a meta operand writes turn meta (their values are now unknown)."""
    flat = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
    for i in _written(func):
        targets = flat[i] if i < len(flat) else None
        for t in (targets if isinstance(targets, (list, tuple)) else [targets]):
            if isinstance(t, SimTensor) and not t._data.is_meta:
                t._data = t._data.to("meta")


def _run_on_backing(func, args, kwargs, *, meta: bool, collective: bool):
    """Run ``func`` on the backing tensors (meta when ``meta``, else CPU) and wrap what it returns: an output that
    is an operand's backing comes back as that operand's SimTensor."""
    wrappers: dict[int, SimTensor] = {}

    def unwrap(a):
        if isinstance(a, SimTensor):
            wrappers[id(a._data)] = a
            if collective and a.dtype in _FLOAT8:
                return a._data.view(torch.uint8)
            return a._data if not meta or collective else _to_meta(a._data)
        if isinstance(a, torch.device) and a == _BACKING:
            return torch.device("meta") if meta else torch.device("cpu")
        if meta and not collective:
            return _to_meta(a)
        return a

    if func in _INDEX_OPS and meta and len(args) > 1:  # boolean indices with real values: their positions
        args = (args[0], _long_indices(args[1]), *args[2:])
    u_args, u_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    if func in _MASKED and meta:
        mask = args[1]._data if isinstance(args[1], SimTensor) else args[1]
        if mask.is_meta:
            raise RuntimeError(f"simulated_cuda(shapes_only): {func} with a mask of unknown values")
        n = int(torch.broadcast_to(mask, torch.broadcast_shapes(mask.shape, args[0].shape)).sum())
        out = torch.empty(n, dtype=args[0].dtype, device="meta")
    elif func is _aten._grouped_mm.default and meta and args[0].dtype != torch.bfloat16:
        # torch's meta kernel of the grouped matmul (moe/grouped.py) takes bf16 operands only, as does its CUDA
        # kernel: the shapes are the same for any dtype, so run it on bf16 stand-ins and give the result its dtype
        def bf16(a):
            return a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a

        out_dtype = u_kwargs.pop("out_dtype", None) or args[0].dtype
        out = func(*tree_map(bf16, u_args), **tree_map(bf16, u_kwargs)).to(out_dtype)
    else:
        out = func(*u_args, **u_kwargs)

    def wrap(o):
        if isinstance(o, torch.Tensor) and not isinstance(o, SimTensor):
            own = wrappers.get(id(o))
            return own if own is not None else SimTensor(o)
        return o

    return tree_map(wrap, out)


class _DeviceDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


# ------------------------------------------------------------------------------------------ the CUDA runtime
class _Stream:
    """A CUDA stream stand-in: work runs in program order on the CPU, so there is nothing to wait for."""

    def __init__(self, *args, **kwargs):
        self.device = DEVICE

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self) -> None:
        pass


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


_STREAM = _Stream()


class _Generator:
    """``torch.cuda.default_generators[i]`` stand-in: keeps the state it is given (Megatron's RNG tracker forks and
    restores it around recomputed regions); the simulated device's random ops draw from the CPU generator."""

    def __init__(self) -> None:
        self._state = torch.get_rng_state()

    def get_state(self) -> torch.Tensor:
        return self._state

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state

    graphsafe_get_state, graphsafe_set_state = get_state, set_state

    def manual_seed(self, seed: int) -> _Generator:
        return self


_GENERATORS = (_Generator(),)


def _record_stream(self, stream) -> None:
    """Tensor.record_stream: streams run in order here, so no tensor must be kept alive for one."""


def _properties(device=None):
    return SimpleNamespace(name="simulated CUDA device (CPU-backed)", major=9, minor=0,
                                 total_memory=80 * 2**30, multi_processor_count=132)


CUDA_STANDINS = {
    "is_available": lambda: True,
    "device_count": lambda: 1,
    "current_device": lambda: 0,
    "set_device": lambda device: None,
    "synchronize": lambda device=None: None,
    "Stream": _Stream,
    "Event": _Event,
    "current_stream": lambda device=None: _STREAM,
    "default_stream": lambda device=None: _STREAM,
    "stream": lambda stream=None: contextlib.nullcontext(),
    "get_device_capability": lambda device=None: (9, 0),
    "get_device_name": lambda device=None: _properties().name,
    "get_device_properties": _properties,
    "default_generators": _GENERATORS,
    "get_rng_state": lambda device="cuda": torch.get_rng_state(),
    "set_rng_state": lambda state, device="cuda": None,
    "manual_seed": lambda seed: None,
    "manual_seed_all": lambda seed: None,
    "memory_allocated": lambda device=None: 0,
    "max_memory_allocated": lambda device=None: 0,
    "max_memory_reserved": lambda device=None: 0,
    "reset_peak_memory_stats": lambda device=None: None,
    "empty_cache": lambda: None,
    "is_initialized": lambda: True,
}


@contextlib.contextmanager
def cuda_runtime_standins() -> Iterator[None]:
    """``torch.cuda``'s runtime calls answered as on a one-GPU machine (``CUDA_STANDINS``). Only where CUDA is
    absent: on a machine with CUDA nothing is replaced (RuntimeError: simulate on the real device instead)."""
    if torch.cuda.is_available():
        raise RuntimeError("simulated_cuda: this machine has CUDA; run on the real device")
    saved = {name: getattr(torch.cuda, name) for name in CUDA_STANDINS}
    saved_random = (torch.cuda.random.get_rng_state, torch.cuda.random.set_rng_state)
    record_stream = torch.Tensor.record_stream
    try:
        torch.Tensor.record_stream = _record_stream
        for name, value in CUDA_STANDINS.items():
            setattr(torch.cuda, name, value)
        torch.cuda.random.get_rng_state = CUDA_STANDINS["get_rng_state"]
        torch.cuda.random.set_rng_state = CUDA_STANDINS["set_rng_state"]
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        torch.cuda.random.get_rng_state, torch.cuda.random.set_rng_state = saved_random
        torch.Tensor.record_stream = record_stream


def _nccl_backend(group=None) -> str:
    """torch.distributed.get_backend inside the simulation: every group stands in for an NCCL one, so
    ``parallelize.group_device`` places collective operands on the (simulated) GPU and its wrappers refuse CPU tensors
    as NCCL would; gloo runs the collective on their CPU values (``_run`` unwraps c10d ops like any other).
    torch's own helpers (``all_gather_object``) still ask the group itself and stage through the CPU, as on gloo."""
    return "nccl"


@contextlib.contextmanager
def simulated_cuda(*, shapes_only: bool = False, tracker=None) -> Iterator[None]:
    """Run the block on one simulated CUDA device (module docstring). Megatron's CPU fixes keyed on CUDA's absence
    are out of force inside and back on exit; so are the environment variables the block sets.

    ``shapes_only``: device tensors hold no values beyond small bookkeeping ones (``_run_shapes``): a model of any
    size builds and steps in no memory. ``tracker``: told of every tensor the device holds (``tracker.add``)."""
    from megatron_qarl.moe import megatron_cpu

    env = dict(os.environ)
    get_backend = dist.get_backend
    megatron_cpu.remove()
    saved_state = (_STATE.shapes_only, _STATE.tracker)
    _STATE.shapes_only, _STATE.tracker = shapes_only, tracker
    try:
        dist.get_backend = _nccl_backend
        with cuda_runtime_standins():
            megatron_cpu.apply()  # now only the fixes whose conditions hold on a GPU machine without TE
            try:
                with _DeviceDispatch(), _CudaArguments():
                    yield
            finally:
                megatron_cpu.remove()
    finally:
        _STATE.shapes_only, _STATE.tracker = saved_state
        dist.get_backend = get_backend
        os.environ.clear()
        os.environ.update(env)
        megatron_cpu.apply()
