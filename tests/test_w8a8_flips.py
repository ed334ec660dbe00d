"""W8A8: the learner and the embedded server differ by their activation codes only (issue 47; tests/w8a8_flips.py,
docs/numerics.md "W8A8: activation-code flips").

- On sequences the server sampled (the tiny checkpoint, R3 as the trainer scores them): the learner fed the
  server's activation codes and scales agrees with the sampler's log-probs within FP32_TOKEN on every token, and a
  token with no code flip at or before its position agrees within FP32_TOKEN as it is. Every flip found is one code
  step (a rounding boundary between the two sides' float32 values).
- A wrong scale on one expert of the server (5%, gate_up of layer 0's expert 0) breaks it: the check is not one
  that flips could excuse.
- The same under the ISA knobs, each set in a fresh process before torch loads MKL / oneDNN / ATen's kernels:
  MKL_ENABLE_INSTRUCTIONS=SSE4_2 and AVX2 (MKL's default, AVX-512 where the CPU has it, is the tests above; on a
  CPU that is not Intel's MKL ignores the knob: there also with MKL dispatching as on an Intel CPU, AVX512 and
  AVX2, ``w8a8_flips.intel_dispatch``), ATEN_CPU_CAPABILITY=default and DNNL_MAX_CPU_ISA=AVX2 (which on aa05666
  made the server's INT8 prefill wrong: oneDNN's u8s8 GEMM capped below VNNI saturates, and the engine used it
  because the CPU has VNNI; serve/kernels/linear.py ``_onednn_int8_exact``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import w8a8_flips as wf
from combination_runs import FP32_TOKEN, within

from megatron_qarl.moe.parallelize import run_ranks

SCHEMES = ("w8a8_fp8", "w8a8_int8")
SEEDS = [1, 2]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, str]:
    from megatron_qarl.qat.export import quantize_checkpoint

    return {s: str(quantize_checkpoint(str(wf.TINY), s, tmp_path_factory.mktemp(s))) for s in SCHEMES}


def _problems(rows: list[dict], scheme: str) -> list[str]:
    """The flip model's problems of each measured run, a flip that is not one code step, and the per-token bound
    of the combination runs (combination_runs.within) over all their tokens."""
    import torch
    from combination_runs import _stats

    out = [f"{scheme} seed {r['seed']}: {p}" for r in rows for p in r["problems"]]
    out += [f"{scheme} seed {r['seed']}: primary flips of {sorted(r['steps'])} code steps" for r in rows
            if set(r["steps"]) - {1, "1"}]
    stats = _stats(torch.tensor([d for r in rows for d in r["diff"]]))
    if not within(stats, scheme):
        out.append(f"{scheme}: per-token figures {stats} outside combination_runs.within")
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_learner_and_the_server_differ_by_their_activation_codes_only(scheme, served):
    rows = run_ranks(1, wf.measure, str(wf.TINY), served[scheme], scheme, SEEDS)[0]
    for r in rows:
        print(f"\n{scheme} seed {r['seed']}: {r['tokens']} tokens, max {r['max']:.2e}, median {r['median']:.2e}, "
              f"{r['flipped_share']:.2f} with a flip upstream, fed learner off by <= {r['residual_max']:.1e}; "
              f"primary flips {r['primary']}, first per sequence {r['first']}")
    assert not _problems(rows, scheme)
    assert all(r["residual_max"] <= FP32_TOKEN for r in rows)


@pytest.mark.multiproc
def test_a_wrong_scale_on_one_expert_is_caught(served):
    rows = run_ranks(1, wf.measure, str(wf.TINY), served["w8a8_fp8"], "w8a8_fp8", SEEDS, 4, 24,
                     {"layer": 0, "expert": 0, "factor": 1.05})[0]
    caught = [p for r in rows for p in r["problems"]]
    print(f"\nplanted 5% on layer 0 expert 0's gate_up scales: {caught}")
    assert caught and all("not explained by the activation codes" in p for p in caught)


def _settings(tmp: Path) -> list[tuple[str, dict[str, str]]]:
    """(name, environment) of the ISA knobs the agreement runs under here."""
    out = [(f"MKL_ENABLE_INSTRUCTIONS={isa}", {"MKL_ENABLE_INSTRUCTIONS": isa}) for isa in ("SSE4_2", "AVX2")]
    out += [("ATEN_CPU_CAPABILITY=default", {"ATEN_CPU_CAPABILITY": "default"}),
           ("DNNL_MAX_CPU_ISA=AVX2", {"DNNL_MAX_CPU_ISA": "AVX2"})]
    intel = wf.intel_dispatch(tmp)
    if intel is not None:  # not an Intel CPU: MKL ignored the knob above; its Intel kernels, as an Intel CPU runs them
        out += [(f"MKL's Intel dispatch, MKL_ENABLE_INSTRUCTIONS={isa}", {**intel, "MKL_ENABLE_INSTRUCTIONS": isa})
                for isa in ("AVX512", "AVX2")]
    return out


@pytest.mark.e2e
def test_the_agreement_holds_under_the_isa_knobs(tmp_path):
    problems = []
    for i, (name, env) in enumerate(_settings(tmp_path)):
        out = tmp_path / f"setting{i}.jsonl"
        done = subprocess.run([sys.executable, str(Path(wf.__file__)), "--scheme", ",".join(SCHEMES), "--seeds",
                               ",".join(map(str, SEEDS)), "--out", str(out)], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            problems.append(f"{name}: exit {done.returncode}: {done.stderr[-3000:]}")
            continue
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        for scheme in SCHEMES:
            mine = [r for r in rows if r["scheme"] == scheme]
            print(f"\n{name} {scheme}: max {max(r['max'] for r in mine):.2e}, fed learner off by <= "
                  f"{max(r['residual_max'] for r in mine):.1e}, first flips {[r['first'][0] for r in mine]}")
            problems += [f"{name}: {p}" for p in _problems(mine, scheme)]
    assert not problems, "\n".join(problems)
