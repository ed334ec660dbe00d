"""SGLang 0.5.23's own code as the judge of what this project sends it, on a CPU-only machine.

What: tests/test_sglang_contract.py checks our launcher's command lines, our HTTP bodies, our quantized
checkpoints' config.json and our weight-sync tensor names with SGLang's own argument parser, request types,
quantization configs, layers and weight loader. This module makes those SGLang pieces importable here and
hands them out: ``server_args()``, ``io_struct()``, ``sampling_params()``, ``api_contract()``,
``quantization()``, ``module(name)``, and ``build_model(dir)`` (SGLang's model, built on CPU by its loader).

Why stand-ins: SGLang is installed with ``pip install --no-deps sglang==0.5.23`` (its dependencies pull
CUDA: sglang-kernel, flashinfer, triton, ...). Importing the modules the tests use touches, at import only,
packages that are then absent. ``install_stubs()`` gives each of them that is not installed an inert
stand-in through a meta-path finder (a module whose every attribute is a dummy: lower-case names are
submodules, Capitalized ones classes that can be subclassed; calls are pass-through decorators):

- GPU-only: ``triton`` (kernels), ``tvm_ffi`` (apache-tvm-ffi, JIT kernels), ``torchvision`` (its wheels are
  CUDA builds pinned to one torch build; SGLang's multimodal processors import it), ``sgl_kernel`` and
  ``flashinfer`` (CUDA kernels, imported where SGLang picks a kernel);
- serving-only: ``zmq`` (IPC), ``orjson`` (responses), ``pybase64`` (image inputs), ``IPython`` (notebook
  display), ``sentencepiece`` / ``gguf`` / ``partial_json_parser`` (tokenizers, GGUF loading, tool-call
  parsing), ``einops`` (model forward code).

None of their code runs in what the tests judge (argument parsing, request validation, quantization config
parsing, layer and parameter creation, weight-name resolution and loading). What SGLang's judged code does
run is real and comes with the ``test`` extra: ``msgspec`` (ServerArgs and the request types are msgspec
Structs), ``openai`` (the OpenAI-protocol types its request models use), ``dill``. One setting:
``SGLANG_USE_CPU_ENGINE=1``, SGLang's own CPU platform, so that its layers build on CPU.

Why a child process: importing SGLang patches transformers (sglang/srt/utils/hf_transformers_patches.py),
sets cache variables in os.environ, and leaves the stand-ins in sys.modules, where torch or Megatron would
take the ``triton`` stand-in for the real one. So the test session never imports SGLang:
``SGLangProcess`` runs the judging functions in one spawned interpreter, which imports SGLang once.

If sglang is not installed, every test that asks for it fails (it is a declared install, README); collecting
the tests does not import it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import multiprocessing
import os
import sys
import traceback
import types
import warnings

SGLANG_VERSION = "0.5.23"

GPU_ONLY = ("triton", "tvm_ffi", "torchvision", "sgl_kernel", "flashinfer")
SERVING_ONLY = ("zmq", "orjson", "pybase64", "IPython", "sentencepiece", "gguf", "partial_json_parser", "einops")
STUB_VERSION = "0.0.0+stub"  # transformers parses __version__ of packages it finds (torchvision, gguf)


class _StubMeta(type):
    """Stand-in classes: any attribute is another stand-in class (``InterpolationMode.BICUBIC``)."""

    def __new__(mcs, name, bases, namespace, **_kwargs):  # class X(Stub, total=False) passes kwargs
        return super().__new__(mcs, name, bases, namespace)

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _StubMeta(name, (_StubClass,), {"__module__": cls.__module__})
        setattr(cls, name, value)
        return value


class _StubClass(metaclass=_StubMeta):
    def __init_subclass__(cls, **_kwargs):
        super().__init_subclass__()

    def __init__(self, *_args, **_kwargs):
        pass

    def __call__(self, *_args, **_kwargs):
        return _StubClass()

    def __getattr__(self, name: str):  # instances too: ``zmq.Context().set(...)`` is a no-op
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubClass()


class _StubModule(types.ModuleType):
    """A stand-in package: attributes are submodules (lower case) or classes (Capitalized); calling it
    is a pass-through decorator (``@triton.jit``, ``@triton.autotune(...)``)."""

    def __init__(self, name: str, loader: importlib.abc.Loader | None = None):
        super().__init__(name)
        self.__path__ = []
        self.__version__ = STUB_VERSION
        self.__spec__ = importlib.machinery.ModuleSpec(name, loader, is_package=True)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if name[:1].isupper():
            value = _StubMeta(name, (_StubClass,), {"__module__": self.__name__})
        else:
            value = sys.modules.setdefault(full, _StubModule(full))
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the stubbed packages (and any of their submodules) with stand-ins."""

    def __init__(self, packages: tuple[str, ...]):
        self.packages = frozenset(packages)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name, self)

    def exec_module(self, module):
        pass


@functools.cache
def install_stubs() -> tuple[str, ...]:
    """Stand-ins for the absent GPU-only and serving-only packages, and SGLang's CPU platform; returns the
    names stubbed. Call only in the SGLang child process (SGLangProcess), never in the test session."""
    absent = tuple(p for p in GPU_ONLY + SERVING_ONLY if importlib.util.find_spec(p) is None)
    if absent:
        sys.meta_path.insert(0, _StubFinder(absent))
    # SGLang's CPU platform (sglang/srt/utils/common.py:221 is_cpu), so its layers build on CPU: otherwise,
    # with no accelerator, e.g. RotaryEmbedding imports vllm's kernel (layers/rotary_embedding/base.py:138)
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    # SGLang warns at import that AWQ/GGUF need CUDA: true, and irrelevant here
    warnings.filterwarnings("ignore", message=r"Only CUDA.*support", category=UserWarning)
    return absent


def _import(name: str) -> types.ModuleType:
    install_stubs()
    if importlib.util.find_spec("sglang") is None:
        raise ImportError(f"sglang is not installed: the contract tests need it (`.venv/bin/pip install --no-deps "
                          f"sglang=={SGLANG_VERSION}`, README)")
    return importlib.import_module(name)


def sglang_version() -> str:
    return _import("sglang.version").__version__


def server_args() -> types.ModuleType:
    """sglang/srt/server_args.py: ServerArgs (add_cli_args, from_cli_args), prepare_server_args."""
    return _import("sglang.srt.server_args")


def io_struct() -> types.ModuleType:
    """sglang/srt/managers/io_struct.py: GenerateReqInput and the weight-update request types."""
    return _import("sglang.srt.managers.io_struct")


def sampling_params() -> type:
    """sglang/srt/sampling/sampling_params.py: SamplingParams (what /generate's sampling_params become)."""
    return _import("sglang.srt.sampling.sampling_params").SamplingParams


def api_contract() -> types.ModuleType:
    """sglang/srt/entrypoints/api_contract.py: generate_contract_error, /generate's 400 gate."""
    return _import("sglang.srt.entrypoints.api_contract")


def quantization() -> types.ModuleType:
    """sglang/srt/layers/quantization/__init__.py: get_quantization_config (the model loader's lookup)."""
    return _import("sglang.srt.layers.quantization")


def module(name: str) -> types.ModuleType:
    """Any other SGLang module, e.g. ``module("sglang.srt.models.qwen3_moe")``."""
    if not name.startswith("sglang"):
        raise ValueError(f"{name}: not an SGLang module")
    return _import(name)


@functools.cache
def cpu_model_parallel() -> None:
    """SGLang's world-1 gloo process groups, which its layers need even at tp=1. Mirrors
    init_single_process_dist (sglang/test/layer_ut_utils.py:13, with publish_build_topology,
    sglang/test/test_utils.py:2101), which cannot be imported here: sglang/test/test_utils.py imports
    SGLang's benchmark datasets (the ``datasets`` package)."""
    import socket

    import torch

    parallel_state = module("sglang.srt.distributed.parallel_state")
    context = module("sglang.srt.runtime_context")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not torch.distributed.is_initialized():
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    context.reset_context()
    context.publish(server_args().ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1), role="test",
                    ranks=context.SpawnRanks(world_rank=0))
    context.get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")


def build_model(model_dir: str):
    """(model_config, quant_config, model): SGLang's ModelConfig of ``model_dir`` (its config.json,
    quantization_config included), the quantization config its loader derives, and the model with the
    parameters the quant methods create, unloaded, on CPU: DefaultModelLoader.load_model
    (sglang/srt/model_loader/loader.py:1011-1018) without its weight loading."""
    import torch

    cpu_model_parallel()
    ModelConfig = module("sglang.srt.configs.model_config").ModelConfig  # noqa: N806
    LoadConfig = module("sglang.srt.configs.load_config").LoadConfig  # noqa: N806
    loader = module("sglang.srt.model_loader.loader")
    set_default_torch_dtype = module("sglang.srt.model_loader.utils").set_default_torch_dtype
    model_config, load_config = ModelConfig(model_dir, dtype="bfloat16"), LoadConfig()
    quant_config = loader._get_quantization_config(model_config, load_config)
    with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        model = loader._initialize_model(model_config, load_config, quant_config)
    return model_config, quant_config, model


def _call(fn, args):
    """``fn(*args)`` in the SGLang process. An exception of an SGLang (or other non-builtin) class comes back as
    its nearest builtin class, its type and traceback in the message: unpickling the original would import
    SGLang into the test session."""
    try:
        return fn(*args)
    except Exception as exc:
        if type(exc).__module__ == "builtins":
            raise
        builtin = next(c for c in type(exc).__mro__ if c.__module__ == "builtins")
        message = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}\n{traceback.format_exc()}"
        try:
            converted = builtin(message)
        except Exception:  # noqa: BLE001 - a builtin with other constructor arguments
            converted = RuntimeError(message)
        raise converted from None


class SGLangProcess:
    """One spawned interpreter that imports SGLang (once) and runs judging functions in it.

    ``run(fn, *args)`` calls ``fn(*args)`` there and returns its result; an exception raised there is
    raised here with its traceback (see ``_call``). ``fn`` must be a module-level function of an importable
    module (e.g. a test module); its arguments and result must be picklable, and of builtin or test-session
    types (a result holding SGLang objects would import SGLang here to unpickle them).
    """

    def __init__(self):
        self._pool = concurrent.futures.ProcessPoolExecutor(max_workers=1,
                                                            mp_context=multiprocessing.get_context("spawn"))

    def submit(self, fn, *args) -> concurrent.futures.Future:
        return self._pool.submit(_call, fn, args)

    def run(self, fn, *args, timeout_s: float = 300.0):
        """``fn(*args)`` there, ``timeout_s`` at most: past it the process is ended (``close``) and the error names
        the call."""
        try:
            return self.submit(fn, *args).result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            raise AssertionError(f"SGLang's process: {fn.__name__} gave no result within {timeout_s:.0f} s "
                                 "(the process was ended)") from None

    def close(self) -> None:
        workers = list(getattr(self._pool, "_processes", {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in workers:  # nothing in it needs an orderly exit (its gloo group takes seconds to tear down)
            p.terminate()
            p.join(10)
