"""The planner against the simulation for run configs: ``qarl plan --config C --simulate --json`` for each config,
in parallel subprocesses, saved under benchmarks/results/memory_sim/, then one markdown table (docs/plan.md).

    python benchmarks/memory_sim.py configs/qwen3-30b-a3b/*.yaml [--jobs 3] [--layers 2 4] [--set key=value ...]
    python benchmarks/memory_sim.py --table                      # the table of what is saved

Each simulation: one learner rank of the config's layout at full width on a shape-only simulated CUDA device
(megatron_qarl.plan.simulate), at each of ``--layers``, extrapolated to the model's layers; minutes per config.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "memory_sim"
GIB = 2**30


def run_one(config: str, layers: list[int], overrides: list[str], name: str | None) -> Path:
    """Simulate ``config`` (with ``overrides``) in a subprocess (``--one``) and save what it prints."""
    name = name or Path(config).stem
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", config, "--layers", *map(str, layers),
           *[f"--set={o}" for o in overrides]]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{config}: {' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    data = json.loads(res.stdout[res.stdout.index("{"):])
    data["command"] = " ".join(["python benchmarks/memory_sim.py", config, *[f"--set {o}" for o in overrides],
                                "--layers", *map(str, layers)] + (["--name", name] if name != Path(config).stem else []))
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


def _replan(d: dict) -> dict[str, int]:
    """The planner's figures for a saved result, recomputed with the planner of this checkout."""
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.plan.cli import PlanOptions, _learner_memory
    from megatron_qarl.plan.memory import LearnerLayout
    from megatron_qarl.preflight.rules import load_config

    cfg = load_config(d["config"], d.get("overrides", []))
    arch = Qwen3MoeArch.from_model_dir(cfg.model.path)
    lay = LearnerLayout(gpus=cfg.world_size, tp=cfg.parallel.tp, ep=cfg.parallel.ep)
    return _learner_memory(cfg, arch, lay, PlanOptions(attention="unfused"))


def table() -> str:
    """Markdown: per config, plan / simulated GiB per phase (the plan recomputed by this checkout's planner) and the
    total's difference."""
    head = ("| config | layout | weights | gradients | optimizer | activations | qat cache | total | plan - sim |\n"
            "|---|---|---|---|---|---|---|---|---|")
    rows = []
    for path in sorted(OUT.glob("*.json")):
        d = json.loads(path.read_text())
        s = d["simulation"]
        planned = _replan(d)
        r = {row["phase"]: dict(row, plan=planned[row["phase"]]) for row in s["rows"]}
        for row in r.values():
            row["diff"] = (row["plan"] - row["simulated"]) / row["simulated"] if row["simulated"] else 0.0
        lay = s["layout"]
        cells = [f"{r[k]['plan'] / GIB:.2f} / {r[k]['simulated'] / GIB:.2f}" for k in
                 ("weights", "gradients", "optimizer", "activations", "qat_cache", "total")]
        rows.append(f"| {path.stem} | tp{lay['tp']}/ep{lay['ep']} on {lay['gpus']} | " + " | ".join(cells)
                    + f" | {r['total']['diff']:+.1%} |")
    return "\n".join([head, *rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--name", default=None, help="result name (one config; default: the config's stem)")
    parser.add_argument("--table", action="store_true", help="print the table of the saved results")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run_one's subprocess: print one simulation
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="key=value",
                        help="a config override for every config (repeatable)")
    args = parser.parse_args()
    overrides = args.overrides
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
