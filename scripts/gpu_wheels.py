"""The wheels scripts/gpu_smoke.sh installs on a GPU machine that has its own torch and no network.

    python scripts/gpu_wheels.py build   [--dest gpu_wheels] [--python 3.12 ...]   here, where PyPI is reachable
    python scripts/gpu_wheels.py install [--dest gpu_wheels]                       there (gpu_smoke.sh runs it)

``build`` downloads (pip download --no-deps, binary wheels only) the exact versions below for CPython on
manylinux x86-64 into ``gpu_wheels/`` (git-ignored; bring it along with the repository, 64 MiB at most) and
prints the folder's size. No torch: the machine's own CUDA build stays. The default Python is 3.12, the lent H200
machines' interpreter; give --python once per other interpreter (megatron-core and pydantic-core are
version-specific, the rest are pure-Python wheels).

``install`` installs, from that folder only (pip --no-index --find-links, --no-deps), each listed distribution the
running interpreter lacks; an ``exact`` one also when its installed version differs, any other one also when its
installed version is older. Nothing else is touched: never torch, never a newer package the machine has.

The list is what the GPU smoke's import closure (megatron_qarl.gpu.smoke: the learner, the sync payload,
Megatron-Core, ModelOpt's quantizers) needs beyond a torch image like the lent H200's (which has numpy, PyYAML,
safetensors, httpx, packaging, scipy, rich, regex, tqdm, ninja, nvidia-ml-py): megatron-core and nvidia-modelopt at
setup.py's pins, pydantic with its exact core and small helpers, and the two packages ModelOpt imports at import
time (pulp, omegaconf; omegaconf 2.4 vendors its antlr runtime).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DEST = REPO / "gpu_wheels"
LIMIT_MIB = 64  # what may travel with the repository to the lent GPU machine

# (distribution, version, exact): exact ones are replaced when another version is installed
WHEELS: tuple[tuple[str, str, bool], ...] = (
    ("megatron-core", "0.16.1", True),
    ("nvidia-modelopt", "0.47.0", True),
    ("pydantic", "2.14.4", True),
    ("pydantic-core", "2.50.5", True),  # pydantic pins its core exactly
    ("annotated-types", "0.8.0", False),
    ("typing-inspection", "0.4.5", False),
    ("typing-extensions", "4.16.0", False),  # pydantic 2.14 needs >= 4.16
    ("pulp", "3.3.2", False),  # imported by modelopt.torch at import time
    ("omegaconf", "2.4.0", False),  # likewise
)

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")


def _version_key(v: str):
    try:
        from packaging.version import Version
    except ImportError:  # pip always vendors it
        from pip._vendor.packaging.version import Version
    return Version(v)


def to_install(installed: dict[str, str | None]) -> list[str]:
    """``name==version`` of every listed wheel to install, given the installed version of each (None: absent)."""
    out = []
    for name, version, exact in WHEELS:
        have = installed.get(name)
        if have is None or (have != version if exact else _version_key(have) < _version_key(version)):
            out.append(f"{name}=={version}")
    return out


def installed_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name, _, _ in WHEELS:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def folder_mib(dest: Path) -> float:
    return sum(f.stat().st_size for f in dest.glob("*.whl")) / 2**20


def build(dest: Path, pythons: list[str]) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # one version of each: a second one would make the install ambiguous
        old.unlink()
    reqs = [f"{n}=={v}" for n, v, _ in WHEELS]
    for py in pythons:
        tag = "cp" + py.replace(".", "")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", py,
               "--implementation", "cp", "--abi", tag, "--abi", "abi3", "--abi", "none",
               *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), *reqs]
        print("$", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            print(f"gpu_wheels: pip download failed for Python {py}", file=sys.stderr)
            return 1
    size = folder_mib(dest)
    for f in sorted(dest.glob("*.whl")):
        print(f"{f.stat().st_size / 2**20:8.2f} MiB  {f.name}")
    print(f"gpu_wheels: {len(list(dest.glob('*.whl')))} wheels, {size:.1f} MiB in {dest} (limit {LIMIT_MIB} MiB)")
    return 0 if size <= LIMIT_MIB else 1


def install(dest: Path) -> int:
    if not any(dest.glob("*.whl")):
        print(f"gpu_wheels: no wheels in {dest}: using the packages this Python has "
              f"(build the folder with: python scripts/gpu_wheels.py build)")
        return 0
    need = to_install(installed_versions())
    if not need:
        print(f"gpu_wheels: {sys.executable} already has every listed package")
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(dest), "--no-deps",
           "--no-cache-dir", "--disable-pip-version-check", "-q", *need]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    print(f"gpu_wheels: {'installed' if rc == 0 else 'FAILED to install'} {' '.join(need)}")
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build", "install"])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--python", action="append", dest="pythons",
                        help="CPython version to download for (repeatable; default 3.12)")
    args = parser.parse_args(argv)
    if args.command == "build":
        return build(args.dest, args.pythons or ["3.12"])
    return install(args.dest)


if __name__ == "__main__":
    sys.exit(main())
