"""The planner against the simulation for run configs: ``qarl plan --config C --simulate --json`` for each config,
in parallel subprocesses, saved under benchmarks/results/memory_sim/, then one markdown table (docs/plan.md).

    python benchmarks/memory_sim.py configs/qwen3-30b-a3b/*.yaml [key.sub=value ...] [--jobs 3] [--layers 2 4]
    python benchmarks/memory_sim.py --table                      # the table of what is saved

Each simulation: one learner rank of the config's layout at full width on a shape-only simulated CUDA device
(megatron_qarl.plan.simulate), at each of ``--layers``, extrapolated to the model's layers; minutes per config.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")  # key.sub=value, as qarl's commands take overrides
OUT = REPO / "benchmarks" / "results" / "memory_sim"
GIB = 2**30


def run_one(config: str, layers: list[int], overrides: list[str], name: str | None) -> Path:
    """Simulate ``config`` (with ``overrides``) in a subprocess (``--one``) and save what it prints."""
    name = name or Path(config).stem
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", config, *overrides, "--layers", *map(str, layers)]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{config}: {' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    data = json.loads(res.stdout[res.stdout.index("{"):])
    named = ["--name", name] if name != Path(config).stem else []
    data["command"] = " ".join([".venv/bin/python benchmarks/memory_sim.py", config, *overrides,
                                "--layers", *map(str, layers), *named])
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    runs = data["simulation"]["simulated"]
    print(f"{name}: done ({', '.join(str(s['seconds']) + ' s' for s in runs)})", flush=True)
    return path


def simulate_one(config: str, layers: list[int], overrides: list[str]) -> dict:
    """One config's simulation (``plan.simulate.simulate_config``), JSON-ready, with its layout."""
    from megatron_qarl.plan.simulate import simulate_config
    from megatron_qarl.preflight.rules import load_config

    cfg = load_config(config, overrides)
    return {"config": config, "overrides": overrides,
            "layout": {"gpus": cfg.world_size, "tp": cfg.parallel.tp, "ep": cfg.parallel.ep},
            "simulation": simulate_config(cfg, layers=tuple(layers))}


def _check(d: dict) -> dict:
    """The saved simulation ``d`` against this checkout's planner (``plan.sim_check``)."""
    from megatron_qarl.plan.layouts import PlanOptions, check_against_plan
    from megatron_qarl.preflight.rules import load_config

    cfg = load_config(d["config"], d.get("overrides", []))
    return check_against_plan(cfg, PlanOptions(attention="unfused"), d["simulation"])


def _saved() -> list[tuple[str, dict]]:
    """(name, result) of every saved simulation in this script's format (every phase)."""
    out = []
    for path in sorted(OUT.glob("*.json")):
        d = json.loads(path.read_text())
        if "extrapolated" in d.get("simulation", {}) and "phases" in d["simulation"]["extrapolated"]:
            out.append((path.stem, d))
    return out


def _cell(rows: list[dict], phase: str, term: str = "total", layers: int | None = None) -> str:
    for r in rows:
        if r["phase"] == phase and r["term"] == term and (layers is None or r["layers"] == layers):
            return f"{r['plan'] / GIB:.2f} / {r['simulated'] / GIB:.2f}"
    return "-"


def table() -> str:
    """Markdown: per config, plan / simulated GiB of every phase's total (sync phases at the largest simulated layer
    count), the peak phase, and the largest relative error of a non-trivial term; then the train step by term."""
    phases = ("logprob_forward", "train_step", "sync_sender", "sync_peer", "checkpoint_save", "eval_forward")
    head = ["| config | layout | " + " | ".join(phases) + " | peak (plan / sim) | largest error | sync: plan - sim |",
            "|---" * (len(phases) + 5) + "|"]
    terms = ["", "| config | weights | gradients | optimizer | qat cache | transient | total |", "|---" * 7 + "|"]
    for name, d in _saved():
        check, sim = _check(d), d["simulation"]
        rows, lay = check["rows"], d["layout"]
        top = max(s["layers"] for s in sim["simulated"])
        cells = [_cell(rows, p, layers=None if p.startswith(("logprob", "train", "checkpoint", "eval")) else top)
                 for p in phases]
        full = {p: v["total"] for p, v in sim["extrapolated"]["phases"].items() if not p.startswith("sync")}
        planned = {r["phase"]: r["plan"] for r in rows if r["term"] == "total" and not r["phase"].startswith("sync")}
        worst = [f"{w['diff']:+.1%} ({w['phase']} {w['term']})" if w else "-"
                 for w in (check["largest"], check["largest_sync"])]
        head.append(f"| {name} | tp{lay['tp']}/ep{lay['ep']} on {lay['gpus']} | " + " | ".join(cells)
                    + f" | {max(planned, key=planned.get)} / {max(full, key=full.get)} | {worst[0]} | {worst[1]} |")
        terms.append(f"| {name} | " + " | ".join(_cell(rows, "train_step", t) for t in
                                                 ("weights", "gradients", "optimizer", "qat_cache", "transient",
                                                  "total")) + " |")
    return "\n".join(head + terms)


def split_overrides(args: list[str]) -> tuple[list[str], list[str]]:
    """(config paths, ``key.sub=value`` overrides) of the positional arguments, in their order."""
    return [a for a in args if not OVERRIDE.match(a)], [a for a in args if OVERRIDE.match(a)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", metavar="CONFIG or key.sub=value",
                        help="run configs, and config overrides for every one of them (as every command takes them)")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--name", default=None, help="result name (one config; default: the config's stem)")
    parser.add_argument("--table", action="store_true", help="print the table of the saved results")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run_one's subprocess: print one simulation
    args = parser.parse_intermixed_args(argv)
    args.configs, overrides = split_overrides(args.configs)
    if args.one:
        print(json.dumps(simulate_one(args.one, args.layers, overrides)))
        return 0
    if args.configs:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda c: run_one(c, args.layers, overrides, args.name), args.configs))
    if args.table or not args.configs:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
