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
    """A tensor on the simulated CUDA device: reports ``cuda:0`` to Python, is "meta" to C++, holds a CPU tensor."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                  storage_offset=data.storage_offset(), dtype=data.dtype,
                                                  device=_BACKING, requires_grad=False)
        out._data = data
        return out

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
        return self._data.data_ptr()
    if func in (torch.Tensor.tolist,):
        return self._data.tolist()
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
            args = tuple(tree_map(lambda a: a._data if isinstance(a, SimTensor) else a, a) for a in args)
            to_device = on_self or _is_cuda(kwargs.get("device"))
            if to_device:
                kwargs["device"] = "cpu"
            out = func(*args, **kwargs)
            return SimTensor(out) if to_device else out
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _BACKING
        return func(*args, **kwargs)


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
    "get_rng_state": lambda device="cuda": torch.get_rng_state(),
    "set_rng_state": lambda state, device="cuda": None,
    "manual_seed": lambda seed: None,
    "manual_seed_all": lambda seed: None,
    "memory_allocated": lambda device=None: 0,
    "max_memory_allocated": lambda device=None: 0,
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
def simulated_cuda() -> Iterator[None]:
    """Run the block on one simulated CUDA device (module docstring). Megatron's CPU fixes keyed on CUDA's absence
    are out of force inside and back on exit; so are the environment variables the block sets."""
    from megatron_qarl import megatron_cpu

    env = dict(os.environ)
    get_backend = dist.get_backend
    megatron_cpu.remove()
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
        dist.get_backend = get_backend
        os.environ.clear()
        os.environ.update(env)
        megatron_cpu.apply()
