"""Building the project's C kernels: one compile-and-cache step for the engine's low-bit kernels
(serve/kernels/native.py) and the exact-numerics kernels (numerics/native.py)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """``$QARL_KERNEL_CACHE`` (default ``~/.cache/megatron_qarl/kernels``): where built libraries are kept."""
    return Path(os.environ.get("QARL_KERNEL_CACHE", Path.home() / ".cache" / "megatron_qarl" / "kernels"))


def compile_shared(cc: str, flags: list[str], sources: list[Path], lib: Path) -> Path:
    """``lib`` if it exists, else ``cc flags -shared -fPIC -o lib sources -lm`` into a temporary name in its folder,
    moved into place atomically (a concurrent build writes the same bytes). Raises RuntimeError with the compiler's
    error output."""
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        tmp_lib = Path(tmp) / lib.name
        cmd = [cc, *flags, "-shared", "-fPIC", "-o", str(tmp_lib), *map(str, sources), "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-800:]}")
        os.replace(tmp_lib, lib)
    return lib
