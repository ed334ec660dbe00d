"""The version rules between a run's environments, as pure functions of what each environment reports
(preflight/probe.py ``facts``): one NCCL in the weight-update group, Transformer Engine inside megatron-core's tested
range, an NVIDIA driver new enough for each torch's CUDA build.

- NCCL: every rank of a communicator exchanges its NCCL version at init and each refuses a peer whose version differs
  ("Mismatched NCCL version detected", ncclInvalidUsage; NCCL's src/init.cc: the version of the library each rank
  LOADED), so the learner's rank 0 and every server must load the same NCCL, to the patch level. Compared: the
  libnccl each environment's torch loaded, as the library answers ``ncclGetVersion`` (preflight/probe.py
  ``loaded_nccl``), never ``torch.cuda.nccl.version()``, which is the nccl.h torch was compiled against; without a
  CUDA torch, the installed nvidia-nccl-cu* package. And no torch runs an NCCL older than the nccl.h it was built
  against: NCCL serves programs built against older headers (a newer libnccl.so.2), not newer ones. So the group's
  one NCCL is the newest any torch of the run is built against: ``ONE_NCCL`` (requirements/nccl.txt, installed in
  every GPU environment; docs/cluster.md "One NCCL").
- Transformer Engine: megatron-core declares the TE it is tested with in its METADATA
  (megatron-core 0.16.1: ``transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0``, its ``dev`` extra); read at
  run time from the installed megatron-core, so the rule follows a new pin.
- Driver: a CUDA build needs a driver of at least its major's minimum (NVIDIA's CUDA minor-version compatibility,
  docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html: CUDA 13.x >= 580, 12.x >= 525,
  11.x >= 450); torch 2.13.0's and 2.14.1's Linux wheels are CUDA 13.0 builds (they require cuda-toolkit 13.0.3).
"""

from __future__ import annotations

import importlib.metadata as md

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

from megatron_qarl.preflight.probe import canonical
from megatron_qarl.preflight.report import Finding

DRIVER_FLOOR = {11: 450, 12: 525, 13: 580}  # CUDA major -> the oldest driver branch that runs it
NCCL_DOC = "docs/cluster.md, \"One NCCL\""
NCCL_REQUIREMENTS = "requirements/nccl.txt"
NCCL_PACKAGE = "nvidia-nccl-cu13"
# the NCCL each torch of our environments is built against: its Linux CUDA wheel's METADATA pins the nvidia-nccl-cu13
# whose nccl.h it was compiled with (``Requires-Dist: nvidia-nccl-cu13==X; platform_system == "Linux"``). torch 2.13.0:
# the learner's (setup.py) and vLLM 0.32's; torch 2.14.1: sglang 0.5.23's. tests/test_nccl_pins.py ties every NCCL
# pin of the repository (requirements, docs/cluster.md, this module) to this table and to an installed CUDA torch.
TORCH_NCCL = {"2.13.0": "2.29.7", "2.14.1": "2.30.7"}
ONE_NCCL = max(TORCH_NCCL.values(), key=Version)  # what every environment of a GPU run loads (requirements/nccl.txt)


# ------------------------------------------------------------------------------------------------- NCCL
def nccl_of(facts: dict) -> tuple[str | None, str]:
    """(the NCCL version an environment loads, where that was read). Where torch is a CUDA build: the version its
    loaded libnccl answers (``nccl_loaded``); a loaded library that cannot say: its distribution's version; no libnccl
    loaded yet: the one nvidia-nccl-cu* installed (a torch that loads it lazily), else NCCL is linked into torch,
    whose build version it then is. Else the nvidia-nccl-cu* distributions
    installed (several different ones answer all of them, joined: never equal to another environment's); (None, why)
    when it has none."""
    pkgs = facts.get("nccl_packages") or {}
    installed = f"; installed {_dists(pkgs)}" if pkgs else ""
    torch_is = f"torch {facts.get('torch')} (CUDA {facts.get('torch_cuda')})"
    build, library, owner = facts.get("nccl_build"), facts.get("nccl_library"), facts.get("nccl_library_dist")
    built = f"; built against {build}" if build else ""
    if facts.get("nccl_loaded"):
        return facts["nccl_loaded"], (f"{torch_is} loaded {library}" + (f" of {owner}" if owner else "") +
                                      f": ncclGetVersion{built}{installed}")
    if facts.get("torch_cuda") and owner and "," not in owner:
        return owner.split("==")[1], f"{torch_is} loaded {library} of {owner} ({facts.get('nccl_error')}){built}"
    if facts.get("torch_cuda") and not library and len(set(pkgs.values())) == 1:  # a torch that maps it lazily
        return next(iter(pkgs.values())), (f"{torch_is} has no libnccl loaded yet: the one installed "
                                           f"{_dists(pkgs)}, which it loads by name{built}")
    if facts.get("torch_cuda") and build and not library:
        return build, f"{torch_is} loads no libnccl: NCCL linked into torch, its build version{installed}"
    if pkgs:
        return "+".join(sorted(set(pkgs.values()))), f"installed {_dists(pkgs)}"
    cuda = facts.get("torch_cuda")
    return None, (f"no NCCL: torch {facts.get('torch')} is a CPU build, no nvidia-nccl package" if not cuda else
                  f"no NCCL: {torch_is} cannot say ({facts.get('nccl_error')}) and no nvidia-nccl package")


def _dists(pkgs: dict[str, str]) -> str:
    return ", ".join(f"{n}=={v}" for n, v in sorted(pkgs.items()))


def _version(text: str | None) -> Version | None:
    try:
        return Version(text) if text and "+" not in text else None
    except InvalidVersion:
        return None


def one_nccl(members: dict[str, dict], have: dict[str, str]) -> str:
    """The NCCL a group of these environments should all load: the newest of ``ONE_NCCL``, every member's torch
    build and every version loaded, since a newer NCCL serves programs built against older headers."""
    seen = [ONE_NCCL, *(f.get("nccl_build") for f in members.values()), *(p for v in have.values()
                                                                            for p in v.split("+"))]
    return str(max((v for v in map(_version, seen) if v is not None), default=Version(ONE_NCCL)))


def _nccl_fix(target: str, labels: list[str], members: dict[str, dict]) -> str:
    """Install ``target`` in each environment of ``labels`` (``learner /path/python``: its interpreter)."""
    names = {n for f in members.values() for n in (f.get("nccl_packages") or {})}
    package = next(iter(sorted(names)), NCCL_PACKAGE)
    how = "; ".join(f"{label}: {label.split(' ', 1)[1] if ' ' in label else '<its python>'} -m pip install "
                    f"--no-deps {package}=={target}" for label in labels)
    return (f"one NCCL, {target}: the newest any member's torch is built against or loads (a newer NCCL serves "
            f"programs built against older headers, not the reverse; {NCCL_REQUIREMENTS}, {NCCL_DOC}), in {how}")


def check_nccl(members: dict[str, dict], backend: str, server_key: str) -> Finding:
    """One NCCL in the weight-update group, as loaded. ``members``: environment label -> facts, the learner's first;
    ``backend``: the group's (gloo on CPU, nccl on GPUs). Environments that have an NCCL must agree (a gloo run in
    them would fail on GPUs), none may load an NCCL older than its torch's nccl.h; under NCCL every member must
    have one. The fix names the newest NCCL of them all (``one_nccl``) and the environments that lack it;
    ``server_key`` is the config key of the servers' environment."""
    found = {label: nccl_of(f) for label, f in members.items()}
    have = {label: v for label, (v, _) in found.items() if v}
    said = "; ".join(f"{label}: {v or '-'} ({via})" for label, (v, via) in found.items())
    learner, target = next(iter(members)), one_nccl(members, have)
    behind = [label for label, v in have.items() if v != target]
    if len(set(have.values())) > 1:
        return Finding("NCCL", False, f"the weight-update group's members load different NCCLs, which NCCL refuses "
                       f"at the first sync (\"Mismatched NCCL version detected\"): {said}", key=server_key,
                       env=", ".join(have), fix=_nccl_fix(target, behind, members))
    below = [label for label, v in have.items() if _version(v) and _version(members[label].get("nccl_build")) and
             _version(v) < _version(members[label].get("nccl_build"))]
    if below:
        return Finding("NCCL", False, f"{', '.join(below)}: torch loads an NCCL older than the nccl.h it is built "
                       f"against; NCCL serves programs built against older headers, not newer ones: {said}",
                       key=server_key if below != [learner] else None, env=", ".join(below),
                       fix=_nccl_fix(target, behind, members))
    if backend == "nccl" and len(have) < len(members):
        lacking = [label for label in members if label not in have]
        return Finding("NCCL", False, f"an NCCL weight-update group (GPUs) with members without NCCL: {said}",
                       key=server_key if learner not in lacking else None, env=", ".join(lacking),
                       fix=f"a CUDA build of torch with its nvidia-nccl package in each ({NCCL_DOC})")
    if not have:
        return Finding("NCCL", True, f"no NCCL in any environment: a {backend} group ({said})")
    return Finding("NCCL", True, f"one NCCL {next(iter(have.values()))} loaded in {len(have)} of {len(members)} "
                   f"environments, a {backend} group: {said}")


# ------------------------------------------------------------------------------------ Transformer Engine
def megatron_te_requirement() -> tuple[str | None, Requirement | None]:
    """(megatron-core's installed version, the transformer-engine requirement of its METADATA), Nones when absent."""
    try:
        dist = md.distribution("megatron-core")
    except md.PackageNotFoundError:
        return None, None
    for line in dist.requires or []:
        req = Requirement(line)
        if canonical(req.name) == "transformer-engine":
            return dist.version, req
    return dist.version, None


def check_te(te_version: str | None, megatron: str | None, requirement: Requirement | None, impl: str) -> Finding:
    """The learner's Transformer Engine inside megatron-core's tested range (``requirement``'s specifier; markers
    such as its ``extra == "dev"`` are where it is declared, not a condition). Not installed passes, unless
    ``model.impl`` is ``te``."""
    if requirement is None:
        return Finding("transformer-engine", megatron is not None or te_version is None,
                       f"megatron-core {megatron or 'not installed'} declares no transformer-engine range; "
                       f"installed: {te_version or 'none'}")
    tested = f"megatron-core {megatron} is tested with transformer-engine{requirement.specifier} " \
             f"(extras {','.join(sorted(requirement.extras)) or 'none'}; its METADATA)"
    if te_version is None:
        if impl == "te":
            return Finding("transformer-engine", False, f"model.impl=te, but the learner's environment has no "
                           f"transformer-engine; {tested}", key="model.impl", env="learner",
                           fix=f"pip install --no-build-isolation \"transformer-engine[core_cu13,pytorch]"
                               f"{requirement.specifier}\" (setup.py's gpu extra), or model.impl=local")
        return Finding("transformer-engine", True, f"not installed in the learner's environment (model.impl={impl}: "
                       f"Megatron's local spec); {tested}")
    try:
        inside = requirement.specifier.contains(Version(te_version), prereleases=True)
    except InvalidVersion:
        inside = False
    if inside:
        return Finding("transformer-engine", True, f"{te_version} in the learner's environment; {tested}")
    return Finding("transformer-engine", False, f"{te_version} in the learner's environment is outside the range "
                   f"{tested}", key="model.impl" if impl != "local" else None, env="learner",
                   fix=f"pip install --no-build-isolation \"transformer-engine[core_cu13,pytorch]"
                       f"{requirement.specifier}\" (setup.py's gpu extra) in the learner's environment, or "
                       f"{_without_te(impl)}")


def _without_te(impl: str) -> str:
    """How the learner runs without Transformer Engine, from its ``model.impl``: uninstalling it is needed in every
    case (megatron-core imports an installed TE whatever the spec: megatron/core/optimizer takes TE's FusedAdam), and
    model.impl=local is offered only where it is not set already."""
    uninstall = "pip uninstall transformer-engine transformer-engine-torch transformer-engine-cu13 there"
    if impl == "local":
        return f"{uninstall} (model.impl is local already; megatron-core still imports an installed TE: its " \
               f"optimizer takes TE's FusedAdam)"
    if impl == "auto":
        return f"{uninstall} (model.impl=auto then builds Megatron's local spec)"
    return f"{uninstall} and set model.impl=local (model.impl={impl} builds the TE spec)"


# ----------------------------------------------------------------------------------------------- driver
def driver_floor(cuda: str) -> int | None:
    """The oldest driver branch that runs a CUDA ``cuda`` build (``"13.0"`` -> 580); None for a major not known."""
    try:
        return DRIVER_FLOOR.get(int(cuda.split(".")[0]))
    except ValueError:
        return None


def check_driver(members: dict[str, dict], gpu_keys: list[str]) -> Finding:
    """Each environment's torch CUDA build against this node's NVIDIA driver. ``gpu_keys``: the config keys that put
    the learner on GPUs (``QarlConfig.gpu_run_keys``; empty: a CPU run). A CPU run passes without CUDA (a CUDA wheel
    runs on a CPU too); a GPU run needs a CUDA build in every environment and a driver of at least its floor, or
    one on which that build's torch initialised CUDA and saw GPUs (``gpus`` > 0: forward compatibility, e.g. NVIDIA's
    cuda-compat package on data-center GPUs, https://docs.nvidia.com/deploy/cuda-compatibility/)."""
    driver = next((f.get("driver") for f in members.values() if f.get("driver")), None)
    cuda = {label: f.get("torch_cuda") for label, f in members.items() if f.get("torch_cuda")}
    key = ", ".join(gpu_keys) or None
    cpu_only = [label for label in members if label not in cuda]
    if gpu_keys and cpu_only:
        return Finding("CUDA driver", False, f"a GPU run ({key}), but torch is a CPU build in {', '.join(cpu_only)}",
                       key=key, env=", ".join(cpu_only), fix="install torch's CUDA build there (PyPI's Linux wheel; "
                                                             "docs/cluster.md, \"Installing\")")
    if not cuda:
        return Finding("CUDA driver", True, f"no CUDA: every environment's torch is a CPU build, a CPU run (driver: "
                       f"{driver or 'none'})")
    builds = "; ".join(f"{label}: torch CUDA {c} (needs driver >= {driver_floor(c) or '?'})"
                       for label, c in cuda.items())
    if driver is None:
        return Finding("CUDA driver", not gpu_keys, f"no NVIDIA driver on this node; {builds}", key=key,
                       env=", ".join(cuda), fix="run on a GPU node with an NVIDIA driver" if gpu_keys else None)
    below = [label for label, c in cuda.items() if (driver_floor(c) or 0) > _major(driver)]
    # NVIDIA's forward compatibility (the cuda-compat package on data-center GPUs) runs a newer CUDA on an older
    # driver branch: where torch did initialise CUDA and saw its GPUs, the driver works for that build
    compat = [label for label in below if members[label].get("gpus")]
    low = [label for label in below if label not in compat]
    if compat and not low:
        return Finding("CUDA driver", True, f"driver {driver} is below the floor of {builds}, but torch initialised "
                       f"CUDA on its GPUs in {', '.join(compat)} (forward compatibility: NVIDIA's cuda-compat)")
    if low:
        need = max(driver_floor(cuda[label]) or 0 for label in low)
        return Finding("CUDA driver", False, f"driver {driver} is older than the CUDA builds need: {builds}",
                       env=", ".join(low), fix=f"an NVIDIA driver >= {need} (R{need}), or a torch build for the "
                                               f"CUDA the driver runs (docs/cluster.md, \"Installing\")")
    return Finding("CUDA driver", True, f"driver {driver}; {builds}")


def _major(driver: str) -> int:
    try:
        return int(driver.split(".")[0])
    except ValueError:
        return 0
