"""The combination space of a run's keys (issue 29), derived from the config's own types, and every combination's
verdict from the one config loader (``preflight.rules.validate_run``): refused at load (the message names the keys
and the reason) or accepted, and then it must run (tests/test_combinations.py, tests/test_vllm_server.py).

The dimensions: rollout.backend x train.async x quant.scheme x algo.routing_replay (R3) x rollout.sync.delta x
train.mismatch_split x algo.loss.mode x algo.loss.mismatch x model.te_fp8 x model.experts x model.attention x the
sampling (temperature, top_p, top_k) x launch.backend x numerics x rollout.kv_cache_dtype. Literal and bool fields
take every value their type allows (``typing.get_args``), so a value added to the config's types joins the space,
the refusal census and the pairwise run plans by itself; the sampling floats take their default and one other value
(a temperature other than 1, a top_p below 1, a top_k on).

Run plans are pairwise (``cover``): every pair of values that some accepted, runnable combination holds is held by
at least one run. The full product is millions of combinations (``SIZE``); pairwise needs a few dozen runs per
backend.

The census does not validate the product (276,480 combinations took 84 s here; model.experts and model.attention
multiplied it by 9; issue 52): it looks, for every backend and every pair of values of two other dimensions, for an
accepted combination holding them (``find``: from every other dimension's first value, changing the dimensions a refusal
names, breadth first, the loader's own messages guiding the search), and validates a seeded random sample of the
product besides (``SAMPLE``). Every combination it looks at must be refused naming a key, or load; every pair an
accepted combination of the sample holds must have been found by the search (tests/test_combinations.py), which
checks the search against combinations it did not choose.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import typing
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from megatron_qarl.algo.policy_loss import PolicyLossConfig
from megatron_qarl.config import (
    AlgoConfig,
    LaunchConfig,
    ModelConfig,
    QarlConfig,
    RolloutConfig,
    SyncConfig,
    TrainConfig,
    load_yaml,
    resolve_paths,
)
from megatron_qarl.errors import ConfigError
from megatron_qarl.preflight.rules import validate_run
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.rollout.manager import SamplingConfig

REPO = Path(__file__).resolve().parents[1]
BASE_YAML = REPO / "configs" / "cpu_default.yaml"


@dataclasses.dataclass(frozen=True)
class Dimension:
    key: str  # the dotted config key
    values: tuple
    source: str  # where the values come from

    def overrides(self, value) -> dict:
        """The keys one value sets: model.te_fp8 true needs TE's layer spec (model.impl te) with it."""
        if self.key == "model.te_fp8" and value:
            return {self.key: True, "model.impl": "te"}
        return {self.key: value}


def type_values(section: type[BaseModel], field: str) -> tuple:
    """Every value a Literal or bool field's type allows."""
    annotation = section.model_fields[field].annotation
    if annotation is bool:
        return (False, True)
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    raise TypeError(f"{section.__name__}.{field}: {annotation} is neither a Literal nor a bool")


def _typed(key: str, section: type[BaseModel], field: str) -> Dimension:
    return Dimension(key, type_values(section, field), f"{section.__name__}.{field}")


def _chosen(key: str, section: type[BaseModel], field: str, other) -> Dimension:
    default = section.model_fields[field].default
    return Dimension(key, (default, other), f"{section.__name__}.{field}: the default and {other}")


DIMENSIONS: tuple[Dimension, ...] = (
    _typed("rollout.backend", RolloutConfig, "backend"),
    _typed("train.async", TrainConfig, "async_mode"),
    _typed("quant.scheme", QuantConfig, "scheme"),
    _typed("algo.routing_replay", AlgoConfig, "routing_replay"),
    _typed("rollout.sync.delta", SyncConfig, "delta"),
    _typed("train.mismatch_split", TrainConfig, "mismatch_split"),
    _typed("algo.loss.mode", PolicyLossConfig, "mode"),
    _typed("algo.loss.mismatch", PolicyLossConfig, "mismatch"),
    _typed("model.te_fp8", ModelConfig, "te_fp8"),
    _typed("model.experts", ModelConfig, "experts"),
    _typed("model.attention", ModelConfig, "attention"),
    _chosen("rollout.sampling.temperature", SamplingConfig, "temperature", 0.7),
    _chosen("rollout.sampling.top_p", SamplingConfig, "top_p", 0.9),
    _chosen("rollout.sampling.top_k", SamplingConfig, "top_k", 20),
    _typed("launch.backend", LaunchConfig, "backend"),
    _typed("numerics", QarlConfig, "numerics"),
    _typed("rollout.kv_cache_dtype", RolloutConfig, "kv_cache_dtype"),
)
KEYS = tuple(d.key for d in DIMENSIONS)
SIZE = int(np.prod([len(d.values) for d in DIMENSIONS]))

# what every combination runs with besides its dimensions: float32 on both sides (the aligned learner and the
# servers compute the same low-bit weights, so their log-probs agree to ~1e-6), and what a backend needs to load
COMMON = {"model.dtype": "float32", "rollout.dtype": "float32"}
# SGLang: bf16 servers (its FP8 KV cache runs FlashInfer, which has no float32 kernels: preflight/rules.py)
BACKEND_BASE = {"embedded": {}, "vllm": {}, "sglang": {"rollout.gpus_per_server": 1, "rollout.dtype": "bfloat16"}}


def overrides_of(combo: tuple) -> dict:
    """The dotted keys a combination sets (values in DIMENSIONS order)."""
    out = dict(COMMON)
    for dim, value in zip(DIMENSIONS, combo, strict=True):
        out.update(dim.overrides(value))
    out.update(BACKEND_BASE[combo[0]])
    if combo[0] == "sglang" and out["quant.scheme"] == "w8a8_fp8":
        out["quant.group_size"] = 64  # the tiny model's attention takes SGLang's FP8 blocks of 64 only
    return out


@functools.cache
def _base() -> dict:
    return resolve_paths(load_yaml(BASE_YAML), BASE_YAML.parent)  # its paths as load_config reads them


def _nested(base: dict, overrides: dict) -> dict:
    """``base`` with dotted ``overrides`` set, copying only the sections they touch."""
    out = dict(base)
    for key, value in overrides.items():
        node, parts = out, key.split(".")
        for part in parts[:-1]:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        node[parts[-1]] = value
    return out


def server_key(scheme: str, numerics: str = "default", kv_cache_dtype: str = "auto") -> str:
    """The key of the test's shared servers for a run: its scheme, /exact for ``numerics: exact`` servers, /<kv>
    for an FP8 KV cache."""
    return "/".join([scheme, *([numerics] if numerics != "default" else []),
                     *([kv_cache_dtype] if kv_cache_dtype != "auto" else [])])


def shared_server_keys(runs: list[tuple], backends: tuple[str, ...] = ("local",)) -> list[tuple[str, str, str]]:
    """(scheme, numerics, kv_cache_dtype) of the shared servers the runs of ``runs`` launched by ``backends`` use."""
    rows = [dict(zip(KEYS, c, strict=True)) for c in runs]
    return sorted({(d["quant.scheme"], d["numerics"], d["rollout.kv_cache_dtype"]) for d in rows
                   if d["launch.backend"] in backends})


def verdict(combo: tuple) -> str | None:
    """None when the combination loads; else the loader's ConfigError message (it names the keys and why)."""
    try:
        validate_run(_nested(_base(), overrides_of(combo)))
    except ConfigError as err:
        return str(err)
    return None


def combinations(backend: str | None = None):
    """Every combination (of one backend, if given), as value tuples in DIMENSIONS order."""
    values = [d.values for d in DIMENSIONS]
    if backend is not None:
        values[0] = (backend,)
    return itertools.product(*values)


_verdicts: dict[tuple, str | None] = {}  # every combination validated so far in this process


def cached_verdict(combo: tuple) -> str | None:
    if combo not in _verdicts:
        _verdicts[combo] = verdict(combo)
    return _verdicts[combo]


def named_dimensions(message: str) -> list[int]:
    """The dimensions a refusal (or a reason not to run) names: every key a dimension's values set, in the text."""
    return [i for i, d in enumerate(DIMENSIONS)
            if any(key in message for key in (d.key, *(k for v in d.values for k in d.overrides(v))))]


def find(fixed: dict[int, object], ok=lambda combo: None, max_states: int = 200) -> tuple | None:
    """An accepted combination with the ``fixed`` values (dimension index -> value) for which ``ok`` (combination ->
    why it will not do, or None) is None: from every other dimension's first value, breadth first, each step
    changing one dimension that the refusal or ``ok``'s reason names to another value, at most ``max_states``
    combinations looked at. None when there is none within that."""
    start = tuple(fixed.get(i, d.values[0]) for i, d in enumerate(DIMENSIONS))
    queue, seen = [start], {start}
    while queue and len(seen) <= max_states:
        combo = queue.pop(0)
        why = cached_verdict(combo)
        if why is None:
            why = ok(combo)
            if why is None:
                return combo
        for i in named_dimensions(why):
            if i in fixed:
                continue
            for v in DIMENSIONS[i].values:
                nxt = combo[:i] + (v,) + combo[i + 1:]
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
    return None


SAMPLE = 4000  # random combinations of the product the census validates besides the search's


def sample(n: int = SAMPLE, seed: int = 0) -> list[tuple]:
    """``n`` combinations of the product, drawn uniformly (seeded: the same on every machine)."""
    rng = np.random.default_rng(seed)
    picks = np.stack([rng.integers(0, len(d.values), n) for d in DIMENSIONS], axis=1)
    return [decode(row) for row in picks]


@functools.cache
def census(backend: str | None = None) -> dict[tuple, str | None]:
    """combination -> verdict, for every combination the census looked at (of one backend, if given): for each pair
    of values of two dimensions other than the backend, the search for an accepted holder (``find``), and the
    random sample (module docstring)."""
    backends = DIMENSIONS[0].values if backend is None else (backend,)
    for b in backends:
        for i, j in itertools.combinations(range(1, len(DIMENSIONS)), 2):
            for a in DIMENSIONS[i].values:
                for v in DIMENSIONS[j].values:
                    find({0: b, i: a, j: v})
    for combo in sample():
        if combo[0] in backends:
            cached_verdict(combo)
    return {c: m for c, m in _verdicts.items() if c[0] in backends}


def rule_of(message: str) -> str:
    """A refusal's rule: its key and the start of its reason, with the values that vary taken out."""
    import re

    first = message.splitlines()[0]
    return re.sub(r"'[^']*'|\b\d+(\.\d+)?\b", "_", first)[:110]


# --------------------------------------------------------------------------------------------- pairwise plans
def _pair_ids(combos: np.ndarray) -> tuple[np.ndarray, int]:
    """Each combination's pairs of (dimension, value index) as integer ids [n, pairs per combination]."""
    sizes = [len(d.values) for d in DIMENSIONS]
    offsets = np.cumsum([0, *sizes])
    n_codes = int(offsets[-1])
    codes = combos + offsets[:-1]
    i, j = np.triu_indices(len(sizes), k=1)
    return codes[:, i] * n_codes + codes[:, j], n_codes * n_codes


def encode(combo: tuple) -> tuple[int, ...]:
    return tuple(d.values.index(v) for d, v in zip(DIMENSIONS, combo, strict=True))


def decode(codes) -> tuple:
    return tuple(d.values[int(c)] for d, c in zip(DIMENSIONS, codes, strict=True))


def pairs_of(combos: list[tuple]) -> set[tuple]:
    """The pairs ((key, value), (key, value)) the combinations hold."""
    out = set()
    for combo in combos:
        items = list(zip(KEYS, combo, strict=True))
        out.update(itertools.combinations(items, 2))
    return out


def run_cost(combo: tuple) -> float:
    """What a run costs, relatively: a Ray launch starts its own actors and servers (about three local runs)."""
    return 3.0 if dict(zip(KEYS, combo, strict=True))["launch.backend"] == "ray" else 1.0


def cover(candidates: list[tuple], cost=run_cost) -> list[tuple]:
    """A few of ``candidates`` that together hold every pair of values any candidate holds (greedy weighted set
    cover: each pick holds the most pairs not yet held per unit of ``cost``; ties go to the earliest candidate, so
    the plan is deterministic)."""
    if not candidates:
        return []
    codes = np.array([encode(c) for c in candidates])
    ids, n_ids = _pair_ids(codes)
    costs = np.array([cost(c) for c in candidates])
    todo = np.zeros(n_ids, dtype=bool)
    todo[np.unique(ids)] = True
    chosen = []
    while todo.any():
        gain = todo[ids].sum(axis=1) / costs
        best = int(gain.argmax())
        chosen.append(best)
        todo[ids[best]] = False
    # then drop, the costliest first, any pick whose pairs the others all hold
    held = np.zeros(n_ids, dtype=np.int64)
    for k in chosen:
        np.add.at(held, np.unique(ids[k]), 1)
    for k in sorted(chosen, key=lambda k: (-costs[k], -chosen.index(k))):
        mine = np.unique(ids[k])
        if (held[mine] > 1).all():
            held[mine] -= 1
            chosen.remove(k)
    return [candidates[k] for k in chosen]


CANDIDATES = 3000  # the most runnable combinations a plan's cover chooses among


def widen(runnable: list[tuple], why, limit: int = CANDIDATES) -> list[tuple]:
    """``runnable`` and the accepted, runnable combinations one dimension away from them, then from those, ... up to
    ``limit``: the candidates of the greedy cover (with only the search's combinations, most of them every other
    dimension's first value, the cover needs more runs: vLLM's plan took 43 runs instead of 19)."""
    out, seen, frontier = list(runnable), set(runnable), list(runnable)
    while frontier and len(out) < limit:
        nxt = []
        for combo in frontier:
            for i in range(1, len(DIMENSIONS)):
                for v in DIMENSIONS[i].values:
                    c = combo[:i] + (v,) + combo[i + 1:]
                    if c in seen:
                        continue
                    seen.add(c)
                    if cached_verdict(c) is None and why(c) is None:
                        nxt.append(c)
        out += nxt[: limit - len(out)]
        frontier = nxt
    return out


def plan(backend: str, verdicts: dict[tuple, str | None], why) -> tuple[list[tuple], dict]:
    """The pairwise run plan of a backend's accepted combinations that ``why`` (combination -> the reason it cannot
    run here, or None) lets run, and the pairs only the others hold (pair -> the reason). For a pair that only
    unrunnable combinations of ``verdicts`` hold, a runnable holder is looked for first (``find``)."""
    accepted = [c for c, m in verdicts.items() if m is None and c[0] == backend]
    runnable = [c for c in accepted if why(c) is None]
    index = {d.key: i for i, d in enumerate(DIMENSIONS)}
    for pair in sorted(pairs_of(accepted) - pairs_of(runnable), key=str):
        found = find({0: backend, **{index[k]: v for k, v in pair}}, ok=why)
        if found is not None:
            runnable.append(found)
            accepted.append(found)
    reasons = {}
    runnable = widen(runnable, why)
    for pair in pairs_of(accepted) - pairs_of(runnable):
        holders = [c for c in accepted if all(dict(zip(KEYS, c, strict=True))[k] == v for k, v in pair)]
        reasons[pair] = "; ".join(sorted({why(c) for c in holders}))
    return cover(runnable), reasons


def as_overrides(combo: tuple) -> list[str]:
    """The combination as ``key=value`` overrides (values as YAML reads them back)."""
    import json

    return [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in overrides_of(combo).items()]


def describe(combo: tuple) -> str:
    """The backend and the values that differ from each dimension's first."""
    out = [combo[0]]
    for d, v in zip(DIMENSIONS[1:], combo[1:], strict=True):
        if v != d.values[0]:
            out.append(f"{d.key.removeprefix('rollout.').removeprefix('algo.')}={v}")
    return " ".join(out)
