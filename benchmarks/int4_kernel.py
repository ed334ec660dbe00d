"""The native W4A16 kernel alone (serve/kernels/int4_gemv.c), one thread, this tree against an earlier revision.

Both builds are loaded side by side and called on the decode shapes (Qwen3-30B-A3B: expert gate_up 1536x2048,
expert down 2048x768, attention qkv 5120x2048; group 128) at 1 and 2 activation rows, over a rotating set of
> 300 MB of weights (they stream from memory, as in decode). Calls alternate between the builds in a shuffled
order and each is timed alone in thread CPU time, so that another process taking the core between calls
costs neither build; per build the fastest call and the 20th percentile are reported, and the outputs of
both builds are compared bit for bit.

    .venv/bin/python benchmarks/int4_kernel.py --before HEAD~1 [--isa avx2] [--calls 300]

``--isa``: the kernel variant both builds run (avx2, avx512, plain; default avx2, which an AVX-512 machine
runs too).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from megatron_qarl.serve.kernels import native

SHAPES = {"expert gate_up 1536x2048": (1536, 2048), "expert down 2048x768": (2048, 768),
          "attention qkv 5120x2048": (5120, 2048)}
GROUP = 128
ROOT = Path(__file__).resolve().parents[1]
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def build_revision(rev: str, out: Path) -> Path:
    """The kernels of git revision ``rev`` compiled as native.build() compiles this tree's."""
    src = out / "src"
    src.mkdir()
    for path in native.SOURCES + native.HEADERS:
        rel = path.resolve().relative_to(ROOT).as_posix()
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], capture_output=True,
                              check=True).stdout
        (src / path.name).write_bytes(text)
    lib = out / "before.so"
    subprocess.run(["cc", "-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-o", str(lib),
                    *(str(src / p.name) for p in native.SOURCES), "-lm"], check=True)
    return lib


def _fn(path: Path):
    fn = ctypes.CDLL(str(path)).qarl_int4_gemm
    fn.argtypes = [_INT, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _INT, _P, _I64, _INT, _INT]
    return fn


def measure(fns: dict, isa: int, n: int, k: int, rows: int, calls: int, g: torch.Generator) -> list[str]:
    """Per build: the fastest call and the 20th percentile (us, GB/s of weight bytes), and whether the
    builds' outputs are equal."""
    nbytes = n * k // 2 + n * (k // GROUP) * 2
    copies = max(8, int(300e6 // nbytes) + 1)
    words = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g) for _ in range(copies)]
    scales = [(torch.rand(n, k // GROUP, generator=g) * 0.01).to(torch.bfloat16) for _ in range(copies)]
    wp, sp = [(_P * 1)(w.data_ptr()) for w in words], [(_P * 1)(s.data_ptr()) for s in scales]
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    out = {name: torch.empty(rows, n, dtype=torch.bfloat16) for name in fns}
    times: dict[str, list[float]] = {name: [] for name in fns}
    order, rnd = list(fns), random.Random(0)

    def call(name: str, c: int) -> None:
        rc = fns[name](isa, x.data_ptr(), rows, k, GROUP, wp[c], sp[c], (_I64 * 1)(n), (_I64 * 1)(0), 1, 0,
                       out[name].data_ptr(), n, 1, 1)
        if rc:
            raise RuntimeError(f"qarl_int4_gemm returned {rc}")

    for i in range(calls):
        rnd.shuffle(order)
        for name in order:
            t0 = time.thread_time()
            call(name, (i * len(fns) + order.index(name)) % copies)
            times[name].append(time.thread_time() - t0)
    for name in fns:
        call(name, 0)
    equal = all(torch.equal(out[name], next(iter(out.values()))) for name in fns)
    cells = []
    for ts in times.values():
        ts.sort()
        cells.append(f"{ts[0] * 1e6:.0f} / {ts[len(ts) // 5] * 1e6:.0f} ({nbytes / ts[0] / 1e9:.1f} GB/s)")
    return cells + [f"{min(times['before']) / min(times['this tree']):.2f}x", "yes" if equal else "NO"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="git revision to compare against")
    ap.add_argument("--isa", default="avx2", choices=sorted(native.ISA_CODES))
    ap.add_argument("--calls", type=int, default=300, help="timed calls per build and point")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fns = {"before": _fn(build_revision(args.before, Path(tmp))), "this tree": _fn(native.build(Path(tmp)))}
        print(f"int4 kernel ({args.isa}), 1 thread; us per call: fastest / 20th percentile\n")
        print("| weight | rows | before | this tree | speedup (fastest) | same bits |\n|---|---|---|---|---|---|")
        g = torch.Generator().manual_seed(0)
        for label, (n, k) in SHAPES.items():
            for rows in (1, 2):
                cells = measure(fns, native.ISA_CODES[args.isa], n, k, rows, args.calls, g)
                print(f"| {label} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
