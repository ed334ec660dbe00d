"""``qarl preflight`` (megatron_qarl/preflight/): a run's environments checked before any weight loads.

Issue 29 items 2 and 3: the learner's torch 2.13.0 loads NCCL 2.29.7, SGLang 0.5.23's torch 2.14.1 NCCL 2.30.7, and
NCCL refuses a communicator whose members differ, so the first weight sync of such a run crashed; the ``gpu`` extra
asked a Transformer Engine outside megatron-core's tested range, and nothing checked the driver against torch's
CUDA 13 build. Issue 38: the NCCL compared is the one each torch LOADED (the probe asks the libnccl in its process,
``ncclGetVersion``), not the nccl.h it was built against (``torch.cuda.nccl.version()``), and no torch may load an
NCCL older than its headers; the TE fix offers only what the config does not already say. Here: the rules as
functions of what each environment reports (against the installed megatron-core's own METADATA), the probe in
processes that loaded libnccl.so.2 libraries compiled here, then ``qarl preflight`` on this machine: passing for
configs/cpu_default.yaml and for a vLLM run (.vllm-venv as the servers' environment, where the probe runs vLLM's own
parser and our vLLM weight-transfer backend's group join), and refusing, all at once and each naming key,
environment and fix, environments whose installed NCCL distributions differ, a Transformer Engine outside the range
and a flag the server's own parser rejects; ``qarl train`` refusing a missing server interpreter before it writes
anything.

The differing environments are real: a folder of distribution records (``<name>-<version>.dist-info/METADATA``, what
pip writes) on the interpreter's sys.path, which importlib.metadata reads inside that interpreter as it reads pip's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_tools import VLLM_PYTHON, needs_vllm

from megatron_qarl import cli
from megatron_qarl.preflight import probe
from megatron_qarl.preflight.probe import NO_NCCL, proc_driver_version
from megatron_qarl.preflight.versions import (
    check_driver,
    check_nccl,
    check_te,
    driver_floor,
    megatron_te_requirement,
)

REPO = Path(__file__).resolve().parents[1]
CPU_DEFAULT = "configs/cpu_default.yaml"
CPU = {"torch": "2.13.0+cpu", "torch_cuda": None, "nccl_packages": {}, "driver": None, **NO_NCCL}
LIB = "/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"


def cuda_env(loaded: str | None, build: str = "2.29.7", driver: str | None = "580.65.06", torch: str = "2.13.0",
             package: str | None = None, library: str | None = LIB) -> dict:
    """An environment's facts as the probe reports a CUDA torch (preflight/probe.py ``facts``): built against the
    nccl.h of ``build``, its process having loaded ``library`` whose ncclGetVersion says ``loaded``, installed by
    nvidia-nccl-cu13 ``package`` (default: ``loaded``)."""
    package = package or loaded or build
    return {"torch": torch, "torch_cuda": "13.0", "driver": driver, "nccl_packages": {"nvidia-nccl-cu13": package},
            "nccl_loaded": loaded, "nccl_build": build, "nccl_library": library,
            "nccl_library_dist": f"nvidia-nccl-cu13=={package}" if library == LIB else None,
            "nccl_error": None if loaded or not library else f"{library} has no symbol ncclGetVersion"}


# ---------------------------------------------------------------------------------------- the rules
def test_nccl_rule_compares_the_loaded_nccls_and_names_the_newest():
    """Issue 38 item 1: the rule compares the NCCL each torch LOADED, not the nccl.h it was built against (what
    ``torch.cuda.nccl.version()`` says). torch 2.13.0 (built against 2.29.7) and 2.14.1 (2.30.7) each on their own
    pin: refused, and the fix puts 2.30.7, the newest, in the learner's environment; with requirements/nccl.txt in
    the learner's environment (it loads 2.30.7, still built against 2.29.7) the group passes."""
    sglang = cuda_env("2.30.7", build="2.30.7", torch="2.14.1")
    bad = check_nccl({"learner /env/bin/python": cuda_env("2.29.7"), "servers /sg/bin/python": sglang}, "nccl",
                     "rollout.server_python")
    assert bad.ok is False and bad.key == "rollout.server_python" and bad.env == "learner /env/bin/python, " \
        "servers /sg/bin/python"
    assert f"learner /env/bin/python: 2.29.7 (torch 2.13.0 (CUDA 13.0) loaded {LIB} of nvidia-nccl-cu13==2.29.7: " \
           "ncclGetVersion; built against 2.29.7" in bad.detail and "Mismatched NCCL" in bad.detail
    assert "servers /sg/bin/python: 2.30.7 (torch 2.14.1 (CUDA 13.0) loaded" in bad.detail
    assert bad.fix.startswith("one NCCL, 2.30.7: the newest any member's torch is built against or loads")
    assert bad.fix.endswith("in learner /env/bin/python: /env/bin/python -m pip install --no-deps "
                            "nvidia-nccl-cu13==2.30.7") and "requirements/nccl.txt" in bad.fix
    fixed = check_nccl({"learner": cuda_env("2.30.7"), "servers": sglang}, "nccl", "k")
    assert fixed.ok and "one NCCL 2.30.7 loaded in 2 of 2 environments, a nccl group" in fixed.detail
    assert "learner: 2.30.7 (torch 2.13.0 (CUDA 13.0) loaded" in fixed.detail and "built against 2.29.7" in \
        fixed.detail
    # a library loaded from elsewhere (LD_LIBRARY_PATH) than the installed package: what is loaded counts
    elsewhere = cuda_env("2.30.7", package="2.29.7", library="/opt/nccl/lib/libnccl.so.2")
    assert check_nccl({"learner": elsewhere, "servers": sglang}, "nccl", "k").ok
    assert not check_nccl({"learner": cuda_env("2.29.7", package="2.30.7", library="/opt/nccl/lib/libnccl.so.2"),
                           "servers": sglang}, "nccl", "k").ok


def test_nccl_rule_refuses_a_torch_below_its_own_headers():
    """Issue 38 item 2: the first arrangement (SGLang's torch 2.14.1, built against 2.30.7, given 2.29.7) loads one
    NCCL in the group, but below the nccl.h of the servers' torch, which NCCL does not promise to serve: refused,
    the servers' key named, the fix 2.30.7 in every environment; the learner alone below its headers names no key."""
    learner, downgraded = cuda_env("2.29.7"), cuda_env("2.29.7", build="2.30.7", torch="2.14.1")
    below = check_nccl({"learner /l/python": learner, "servers /s/python": downgraded}, "nccl",
                       "rollout.server_python")
    assert below.ok is False and below.key == "rollout.server_python" and below.env == "servers /s/python"
    assert "servers /s/python: torch loads an NCCL older than the nccl.h it is built against" in below.detail
    assert "servers /s/python: 2.29.7 (torch 2.14.1 (CUDA 13.0) loaded" in below.detail and \
        "built against 2.30.7" in below.detail
    assert "learner /l/python: /l/python -m pip install --no-deps nvidia-nccl-cu13==2.30.7; servers /s/python: " \
           "/s/python -m pip install --no-deps nvidia-nccl-cu13==2.30.7" in below.fix
    alone = check_nccl({"learner": cuda_env("2.29.7", build="2.30.7")}, "nccl", "rollout.server_python")
    assert alone.ok is False and alone.key is None and alone.env == "learner"


def test_nccl_rule_without_a_readable_library():
    """A CUDA torch whose loaded libnccl cannot say (no ncclGetVersion): the version of the distribution that
    installed it; no libnccl loaded at all: NCCL linked into torch, its build version; neither: none (refused in
    an NCCL group); a CPU member passes in a gloo group only."""
    mute = cuda_env(None, build="2.30.7", package="2.30.7")
    assert mute["nccl_library_dist"] == "nvidia-nccl-cu13==2.30.7" and mute["nccl_loaded"] is None
    found = check_nccl({"learner": cuda_env("2.30.7"), "servers": mute}, "nccl", "k")
    assert found.ok and f"servers: 2.30.7 (torch 2.13.0 (CUDA 13.0) loaded {LIB} of nvidia-nccl-cu13==2.30.7 " \
        f"({LIB} has no symbol ncclGetVersion); built against 2.30.7)" in found.detail
    static = {**cuda_env(None, build="2.29.7", library=None), "nccl_packages": {}}
    assert "learner: 2.29.7 (torch 2.13.0 (CUDA 13.0) loads no libnccl: NCCL linked into torch, its build version)" \
        in check_nccl({"learner": static}, "nccl", "k").detail
    # a torch that loads libnccl lazily (nothing mapped when the probe asks): the one nvidia-nccl installed, which
    # it will load by name, not its build version (review of issue 38: every GPU run would have been refused)
    lazy = {**cuda_env(None, build="2.29.7", library=None), "nccl_packages": {"nvidia-nccl-cu13": "2.30.7"}}
    found = check_nccl({"learner": lazy, "servers": cuda_env("2.30.7")}, "nccl", "k")
    assert found.ok and "learner: 2.30.7 (torch 2.13.0 (CUDA 13.0) has no libnccl loaded yet: the one installed " \
        "nvidia-nccl-cu13==2.30.7, which it loads by name; built against 2.29.7)" in found.detail, found.detail
    unknown = {**cuda_env(None, library="/x/libnccl.so.2"), "nccl_packages": {}, "nccl_build": None}
    lacking = check_nccl({"learner": cuda_env("2.30.7"), "servers": unknown}, "nccl", "rollout.server_python")
    assert lacking.ok is False and lacking.env == "servers" and lacking.key == "rollout.server_python"
    assert "servers: - (no NCCL: torch 2.13.0 (CUDA 13.0) cannot say (/x/libnccl.so.2 has no symbol ncclGetVersion)" \
        in lacking.detail
    assert check_nccl({"learner": CPU, "servers": CPU}, "gloo", "k").ok
    assert check_nccl({"learner": CPU, "servers": cuda_env("2.30.7")}, "gloo", "k").ok
    lacking = check_nccl({"learner": cuda_env("2.30.7"), "servers": CPU}, "nccl", "rollout.server_python")
    assert lacking.ok is False and lacking.env == "servers" and lacking.key == "rollout.server_python"


# ---------------------------------------------------------------------------------------- the probe
def fake_nccl(folder: Path, version: str | None, result: int = 0) -> Path:
    """``folder/libnccl.so.2``, compiled here, whose ``ncclGetVersion`` answers ``version`` encoded as nccl.h's
    NCCL_VERSION does (2.30.7 -> 23007, 2.8.4 -> 2804) and returns ``result``; ``version`` None: a library without
    that symbol."""
    folder.mkdir(parents=True, exist_ok=True)
    if version is None:
        source = "int ncclCommCount(void *comm, int *count) { *count = 1; return 0; }\n"
    else:
        major, minor, patch = (int(p) for p in version.split("."))
        code = major * (10000 if (major, minor) >= (2, 9) else 1000) + minor * 100 + patch
        source = f"int ncclGetVersion(int *version) {{ *version = {code}; return {result}; }}\n"
    (folder / "nccl.c").write_text(source)
    lib = folder / "libnccl.so.2"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(folder / "nccl.c")], check=True)
    return lib


def nccl_site(folder: Path, version: str) -> tuple[Path, Path]:
    """(a site folder as ``pip install nvidia-nccl-cu13==version`` leaves it: nvidia/nccl/lib/libnccl.so.2 and its
    dist-info with the RECORD naming the library, the library)."""
    lib = fake_nccl(folder / "nvidia" / "nccl" / "lib", version)
    info = folder / f"nvidia_nccl_cu13-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-nccl-cu13\nVersion: {version}\n")
    (info / "RECORD").write_text("nvidia/nccl/lib/libnccl.so.2,,\n")
    return folder, lib


# a process that has loaded the given libraries (as a CUDA torch's libtorch_cuda.so loads libnccl.so.2), asked
# by the probe file run as the servers' interpreter runs it (runpy: only the standard library)
LOADED = ("import ctypes, json, runpy, sys\n"
          "for lib in sys.argv[2:]:\n    ctypes.CDLL(lib)\n"
          "print(json.dumps(runpy.run_path(sys.argv[1])['loaded_nccl']()))\n")


def loaded_in_process(*libs: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", LOADED, probe.__file__, *map(str, libs)], capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_probe_asks_the_loaded_libnccl_its_version(tmp_path):
    """Issue 38 item 1: the probe finds the libnccl its process loaded (/proc/self/maps) and asks that library
    (ncclGetVersion through ctypes, RTLD_NOLOAD: nothing new is loaded); both encodings of the version; a library
    without the symbol, one whose call fails, and a process without libnccl say so."""
    assert [probe.nccl_version_string(c) for c in (23007, 22907, 21903, 20906, 2804, 2207, 99)] == \
        ["2.30.7", "2.29.7", "2.19.3", "2.9.6", "2.8.4", "2.2.7", None]
    new, old = fake_nccl(tmp_path / "a", "2.29.7"), fake_nccl(tmp_path / "b", "2.8.4")
    mute, failing = fake_nccl(tmp_path / "c", None), fake_nccl(tmp_path / "d", "2.30.7", result=5)
    assert loaded_in_process(new) == {"nccl_loaded": "2.29.7", "nccl_library": str(new), "nccl_library_dist": None,
                                      "nccl_error": None}
    assert loaded_in_process(old)["nccl_loaded"] == "2.8.4"
    assert loaded_in_process(mute) == {"nccl_loaded": None, "nccl_library": str(mute), "nccl_library_dist": None,
                                       "nccl_error": f"{mute} has no symbol ncclGetVersion"}
    assert loaded_in_process(failing)["nccl_error"] == f"{failing}: ncclGetVersion returned ncclResult 5"
    assert loaded_in_process() == {"nccl_loaded": None, "nccl_library": None, "nccl_library_dist": None,
                                   "nccl_error": "no libnccl is loaded in this process"}
    both = loaded_in_process(new, old)
    assert both["nccl_loaded"] == "2.29.7+2.8.4" and sorted(both["nccl_library"].split(", ")) == [str(new), str(old)]
    # a library this process has not loaded is not loaded by asking it
    version, why = probe.library_nccl_version(str(new))
    assert version is None and why.startswith(f"{new} is mapped but not loaded as a library")
    assert str(new) not in probe.mapped_libraries(probe.NCCL_LIB)
    maps = tmp_path / "maps"
    maps.write_text("7f0-7f1 r-xp 00000000 08:01 42  /opt/my env/lib/libnccl.so.2.30.7\n"
                    "7f1-7f2 r--p 00001000 08:01 42  /opt/my env/lib/libnccl.so.2.30.7\n"
                    "7f2-7f3 r-xp 00000000 08:01 43  /opt/lib/libnccl-net.so\n"
                    "7f3-7f4 r-xp 00000000 08:01 44  /old/libnccl.so.2 (deleted)\n7f4-7f5 rw-p 00000000 00:00 0\n")
    assert probe.mapped_libraries(probe.NCCL_LIB, maps) == ["/opt/my env/lib/libnccl.so.2.30.7", "/old/libnccl.so.2"]


# a CUDA build of torch, on this CPU wheel: torch.version.cuda, the nccl.h version torch/csrc/cuda/nccl.cpp packs
# into torch._C._nccl_version() (major << 32 | minor << 16 | patch), and the libnccl.so.2 its libtorch_cuda.so loads
CUDA_TORCH = """import ctypes, json, sys
import torch
major, minor, patch = (int(p) for p in sys.argv[1].split("."))
torch.version.cuda = "13.0"
torch._C._nccl_version = lambda: major << 32 | minor << 16 | patch
torch._C._nccl_version_suffix = lambda: b""
ctypes.CDLL(sys.argv[2])
from megatron_qarl.preflight import probe
print(json.dumps(probe.facts()))
"""


def test_probe_reports_the_nccl_torch_loaded_not_the_one_it_was_built_against(tmp_path):
    """Issue 38 item 1: a torch built against 2.30.7 (2.14.1, SGLang's) whose environment holds nvidia-nccl-cu13
    2.29.7 loads 2.29.7, and the probe says so (``torch.cuda.nccl.version()`` says 2.30.7 either way); the rule
    then compares what is loaded: torch 2.13.0 built against 2.29.7 with requirements/nccl.txt's 2.30.7 and
    torch 2.14.1 on its own 2.30.7 are one NCCL; 2.14.1 given 2.29.7 is one NCCL below its headers, refused."""
    sites = {v: nccl_site(tmp_path / f"site-{v}", v) for v in ("2.29.7", "2.30.7")}
    runs = {(build, lib): subprocess.Popen(
        [sys.executable, "-c", CUDA_TORCH, build, str(sites[lib][1])], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": f"{sites[lib][0]}:{REPO}"})
        for build, lib in (("2.30.7", "2.29.7"), ("2.29.7", "2.29.7"), ("2.29.7", "2.30.7"), ("2.30.7", "2.30.7"))}
    facts = {key: json.loads(run.communicate(timeout=300)[0]) for key, run in runs.items()}
    downgraded = facts[("2.30.7", "2.29.7")]
    assert (downgraded["torch_cuda"], downgraded["nccl_build"], downgraded["nccl_loaded"]) == \
        ("13.0", "2.30.7", "2.29.7")
    assert downgraded["nccl_library"] == str(sites["2.29.7"][1]) and downgraded["nccl_error"] is None
    assert downgraded["nccl_library_dist"] == "nvidia-nccl-cu13==2.29.7"
    assert downgraded["nccl_packages"] == {"nvidia-nccl-cu13": "2.29.7"} and "nccl_runtime" not in downgraded
    one = check_nccl({"learner": facts[("2.29.7", "2.30.7")], "servers": facts[("2.30.7", "2.30.7")]}, "nccl", "k")
    assert one.ok and "one NCCL 2.30.7 loaded in 2 of 2 environments" in one.detail
    below = check_nccl({"learner": facts[("2.29.7", "2.29.7")], "servers": downgraded}, "nccl", "rollout.server_python")
    assert below.ok is False and below.env == "servers" and below.key == "rollout.server_python"
    assert f"servers: 2.29.7 (torch {downgraded['torch']} (CUDA 13.0) loaded {sites['2.29.7'][1]} of " \
           f"nvidia-nccl-cu13==2.29.7: ncclGetVersion; built against 2.30.7" in below.detail
    two = check_nccl({"learner": facts[("2.29.7", "2.29.7")], "servers": facts[("2.30.7", "2.30.7")]}, "nccl", "k")
    assert two.ok is False and "learner: <its python> -m pip install --no-deps nvidia-nccl-cu13==2.30.7" in two.fix


def test_te_rule_reads_megatron_cores_own_range():
    """Item 3: the range is megatron-core's METADATA's (0.16.1: >=2.9.0a0,<2.12.0); 2.20.2, what the old
    ``transformer-engine[pytorch]>=2.4`` installs today, is refused, naming the fix; no TE passes unless
    model.impl is te."""
    megatron, req = megatron_te_requirement()
    assert megatron == "0.16.1" and str(req.specifier) == "<2.12.0,>=2.9.0a0" and "core_cu13" in req.extras
    assert check_te("2.11.0", megatron, req, "auto").ok and check_te("2.9.0", megatron, req, "te").ok
    for outside in ("2.20.2", "2.4.0", "2.12.0"):
        found = check_te(outside, megatron, req, "auto")
        assert found.ok is False and found.key == "model.impl" and found.env == "learner", outside
        assert 'transformer-engine[core_cu13,pytorch]<2.12.0,>=2.9.0a0' in found.fix
    assert check_te(None, megatron, req, "auto").ok and not check_te(None, megatron, req, "te").ok


def test_te_fix_offers_only_what_the_config_does_not_already_say():
    """Issue 38 item 7: an out-of-range TE under model.impl=local is not fixed by model.impl=local (it is set, and
    megatron-core imports an installed TE whatever the spec: its optimizer takes TE's FusedAdam): the fix is the
    tested range or uninstalling TE, and no config key is blamed; under auto, uninstalling TE is enough (auto then
    builds the local spec); under te, uninstalling also needs model.impl=local."""
    megatron, req = megatron_te_requirement()
    local = check_te("2.20.2", megatron, req, "local")
    assert local.ok is False and local.key is None and local.env == "learner"
    assert "model.impl=local" not in local.fix and "model.impl is local already" in local.fix
    assert local.fix.startswith('pip install --no-build-isolation "transformer-engine[core_cu13,pytorch]<2.12.0,'
                                '>=2.9.0a0" (setup.py\'s gpu extra) in the learner\'s environment, or pip uninstall '
                                'transformer-engine transformer-engine-torch transformer-engine-cu13 there')
    auto = check_te("2.20.2", megatron, req, "auto")
    assert auto.key == "model.impl" and "model.impl=local" not in auto.fix and \
        "(model.impl=auto then builds Megatron's local spec)" in auto.fix
    te = check_te("2.20.2", megatron, req, "te")
    assert te.key == "model.impl" and "pip uninstall transformer-engine" in te.fix and \
        "and set model.impl=local (model.impl=te builds the TE spec)" in te.fix
    missing = check_te(None, megatron, req, "te")  # model.impl=te without TE: local is the other way
    assert missing.key == "model.impl" and missing.fix.endswith("or model.impl=local")


def test_driver_rule_cuda_13_needs_r580():
    """Item 3: torch 2.13's Linux wheel is a CUDA 13.0 build, which needs driver 580 or newer."""
    assert (driver_floor("13.0"), driver_floor("12.8"), driver_floor("11.8"), driver_floor("14.0")) == \
        (580, 525, 450, None)
    gpu = ["launch.gpus_per_node=8"]
    old = check_driver({"learner": cuda_env("2.29.7", driver="570.124.06")}, gpu)
    assert old.ok is False and "R580" in old.fix and "570.124.06" in old.detail and old.env == "learner"
    assert check_driver({"learner": cuda_env("2.29.7", driver="580.65.06")}, gpu).ok
    # an older branch on which torch did initialise CUDA and saw its GPUs: forward compatibility (cuda-compat)
    compat = check_driver({"learner": {**cuda_env("2.29.7", driver="570.124.06"), "gpus": 8}}, gpu)
    assert compat.ok and "forward compatibility" in compat.detail
    mixed = check_driver({"learner": {**cuda_env("2.29.7", driver="570.124.06"), "gpus": 8},
                          "servers": cuda_env("2.29.7", driver="570.124.06")}, gpu)
    assert mixed.ok is False and mixed.env == "servers"
    assert check_driver({"learner": CPU, "servers": CPU}, []).ok  # a CPU run: no CUDA, no driver
    cpu_torch = check_driver({"learner": CPU}, gpu)  # a GPU run on a CPU build of torch
    assert cpu_torch.ok is False and cpu_torch.key == "launch.gpus_per_node=8"
    # the driver as /proc/driver/nvidia/version says it (proprietary and open kernel modules)
    assert proc_driver_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC "
                               "2024\nGCC version:  gcc version 12.2.0\n") == "550.54.15"
    assert proc_driver_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
                               "(dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 06:54:38 UTC 2025\n") == "580.65.06"
    no_driver = check_driver({"learner": cuda_env("2.29.7", driver=None)}, [])
    assert no_driver.ok and not check_driver({"learner": cuda_env("2.29.7", driver=None)}, gpu).ok


# ----------------------------------------------------------------------------------- qarl preflight
def site(folder: Path, **versions: str) -> Path:
    """A folder of distribution records as pip writes them, e.g. ``site(p, nvidia_nccl_cu13="2.30.7")``."""
    for name, version in versions.items():
        info = folder / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    return folder


def server_python(folder: Path, site_dir: Path) -> str:
    """The servers' own environment: this venv's interpreter with ``site_dir`` and this checkout on its path."""
    (folder / "bin").mkdir(parents=True)
    python = folder / "bin" / "python"
    python.write_text(f'#!/bin/bash\nexport PYTHONPATH={site_dir}:{REPO}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


def preflight(*overrides: str, learner_site: Path | None = None) -> subprocess.CompletedProcess:
    path = f"{learner_site}:{REPO}" if learner_site else str(REPO)
    return subprocess.run([sys.executable, "-m", "megatron_qarl.cli", "preflight", "--config", CPU_DEFAULT,
                           *overrides], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "PYTHONPATH": path})


def lines(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """The report's line of each check (with its fix line), by check name."""
    out, current = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith(("  ok    ", "  FAIL  ", "  skip  ")):
            current = line[8:].split(":")[0].split(" [")[0]
            out[current] = line
        elif line.startswith("        fix: ") and current:
            out[current] += "\n" + line
    return out


CHECKS = ["GPU memory plan", "bounded waits", "data", "learner's environment", "servers' environment", "NCCL",
          "transformer-engine", "CUDA driver", "server command", "weight-update round trip"]


@pytest.mark.e2e
def test_preflight_passes_the_cpu_default_run():
    proc = preflight()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = lines(proc)
    assert list(found) == CHECKS and all(line.startswith("  ok    ") for line in found.values()), proc.stdout
    assert "no NCCL in any environment: a gloo group" in found["NCCL"]
    assert "a gloo group of this process" in found["weight-update round trip"]
    assert "one bucket of 5 tensors (bfloat16, float32, int32, int8" in found["weight-update round trip"]
    assert "received identical (sha256)" in found["weight-update round trip"]
    assert f"preflight: all {len(CHECKS)} checks passed" in proc.stdout


@needs_vllm
@pytest.mark.e2e
def test_preflight_passes_a_vllm_run():
    """The servers' environment is .vllm-venv (no megatron_qarl): the probe imports vLLM there, vLLM's own parser
    takes the command, and the round trip's rank 1 joins through our vLLM weight-transfer backend's join_group."""
    proc = preflight("rollout.backend=vllm", f"rollout.server_python={VLLM_PYTHON}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = lines(proc)
    assert all(line.startswith("  ok    ") for line in found.values()), proc.stdout
    assert f"servers {VLLM_PYTHON}: python" in found["servers' environment"] and "imports vllm 0.32.0" in \
        found["servers' environment"]
    assert "arguments for rollout.backend=vllm accepted by the backend's own parser" in found["server command"]
    assert f"and servers {VLLM_PYTHON} (rank 1)" in found["weight-update round trip"]


@pytest.mark.e2e
def test_preflight_lists_every_problem_at_once_naming_key_environment_and_fix(tmp_path):
    """The learner's environment holds nvidia-nccl-cu13 2.29.7 (torch 2.13.0's pin) and transformer-engine 2.20.2,
    the servers' nvidia-nccl-cu13 2.30.7 (torch 2.14.1's, SGLang 0.5.23's), and the server host starts with a dash,
    which `qarl serve`'s parser (run in the servers' environment) takes for a flag: three problems in one report,
    exit 1 (the NCCL fix: the newer 2.30.7 in the learner's environment); the rest (the gloo round trip among them)
    still passes."""
    learner = site(tmp_path / "learner-site", nvidia_nccl_cu13="2.29.7", transformer_engine="2.20.2")
    servers = server_python(tmp_path / "server-env", site(tmp_path / "server-site", nvidia_nccl_cu13="2.30.7"))
    proc = preflight(f"rollout.server_python={servers}", "launch.server_host=-x", learner_site=learner)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = lines(proc)
    assert list(found) == CHECKS, proc.stdout
    failed = {name for name, line in found.items() if line.startswith("  FAIL  ")}
    assert failed == {"NCCL", "transformer-engine", "server command"}, proc.stdout
    assert f"[rollout.server_python; learner {sys.executable}, servers {servers}]" in found["NCCL"]
    assert f"learner {sys.executable}: 2.29.7 (installed nvidia-nccl-cu13==2.29.7)" in found["NCCL"]
    assert f"servers {servers}: 2.30.7 (installed nvidia-nccl-cu13==2.30.7)" in found["NCCL"]
    assert "fix: one NCCL, 2.30.7: the newest any member's torch is built against or loads" in found["NCCL"]
    assert f"in learner {sys.executable}: {sys.executable} -m pip install --no-deps nvidia-nccl-cu13==2.30.7" in \
        found["NCCL"]
    assert "[model.impl; learner]: 2.20.2 in the learner's environment is outside the range megatron-core 0.16.1 " \
           "is tested with transformer-engine<2.12.0,>=2.9.0a0" in found["transformer-engine"]
    assert f"[launch.server_host; servers {servers}]" in found["server command"]
    assert "qarl serve: error: argument --host: expected one argument" in found["server command"]
    assert "received identical (sha256)" in found["weight-update round trip"]
    assert f"preflight: 3 problems of {len(CHECKS)} checks: the run would fail" in proc.stdout


def test_qarl_train_refuses_a_missing_server_python_before_writing_anything(tmp_path, capsys):
    """The cheap part of preflight runs in qarl train before anything is built; its report names the key."""
    out = tmp_path / "run"
    rc = cli.main(["train", "--config", str(REPO / CPU_DEFAULT), f"train.output_dir={out}",
                   f"rollout.server_python={tmp_path}/nowhere/bin/python"])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists(), err
    assert "the run's environments are not ready (qarl preflight --config" in err
    assert f"FAIL  servers' environment [rollout.server_python; servers {tmp_path}/nowhere/bin/python]: " \
           f"rollout.server_python: '{tmp_path}/nowhere/bin/python' is not an executable file" in err
    assert "fix: install megatron_qarl" in err and "preflight: 1 problem of 4 checks" in err



def test_preflight_reports_the_waits_bounds_and_refuses_a_nccl_that_would_not_honour_them():
    """Issue 46: every wait is bounded. The bounds are in the report; a GPU run whose learner environment sets
    TORCH_NCCL_ASYNC_ERROR_HANDLING=0 is a problem naming launch.collective_timeout_s (torch's watchdog would only
    log a stuck NCCL collective); a CPU run (gloo honours the timeout itself) is not; and the load refuses a rank
    timeout that does not exceed the collective one, naming both keys."""
    from megatron_qarl.errors import ConfigError
    from megatron_qarl.preflight.cli import timeouts_finding
    from megatron_qarl.preflight.rules import load_config

    gpu = load_config("configs/qwen3-30b-a3b/w4a16_tbpo_2x8.yaml")
    ok = timeouts_finding(gpu, environ={})
    assert ok.ok and ("launch.collective_timeout_s 300 s, launch.checkpoint_timeout_s 3600 s and the sync's peer "
                      "wait 1260 s (2 x rollout.sync.timeout_s 600 s + 60 s) < launch.rank_timeout_s 7200 s"
                      in ok.detail), ok
    bad = timeouts_finding(gpu, environ={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert bad.ok is False and bad.key == "launch.collective_timeout_s" and "only logged" in bad.detail, bad
    assert timeouts_finding(gpu, environ={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": "1"}).ok
    # issue 53: torch honours the legacy names too (the TORCH_ one wins where both are set; ProcessGroupNCCL.hpp)
    legacy = timeouts_finding(gpu, environ={"NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert legacy.ok is False and "NCCL_ASYNC_ERROR_HANDLING=0 (torch's legacy name of " in legacy.detail, legacy
    assert timeouts_finding(gpu, environ={"NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_BLOCKING_WAIT": "true"}).ok
    assert timeouts_finding(gpu, environ={"NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}).ok
    assert not timeouts_finding(gpu, environ={"TORCH_NCCL_BLOCKING_WAIT": "maybe"}).ok
    assert timeouts_finding(load_config("configs/cpu_default.yaml"),
                            environ={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}).ok
    with pytest.raises(ConfigError, match=r"launch\.rank_timeout_s: 60 s must be above launch\.collective_timeout_s"):
        load_config("configs/cpu_default.yaml", ["launch.rank_timeout_s=60", "launch.collective_timeout_s=120"])
