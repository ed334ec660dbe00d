"""Training checkpoints: Megatron-Core dist-checkpointing for the sharded model and optimizer, per-rank
RNG states, and the trainer's own state (step, data position, weight version, counters) as JSON.

Layout of ``<output_dir>/checkpoints``::

    step_000020/            one checkpoint (dist-checkpointing files, rng_rank{r}.pt, trainer_state.json)
    step_000040/
    latest                  the name of the newest complete checkpoint

Atomic: everything is written into ``step_000040.tmp`` and renamed when complete, then ``latest`` is
replaced (write + os.replace). A crash at any moment leaves the previous checkpoint intact and
``latest`` pointing at a complete one. Only the newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_qarl.errors import UserError
from megatron_qarl.moe.convert import layer_spec_of, model_impl
from megatron_qarl.moe.megatron_cpu import adam_step

STATE_FILE = "trainer_state.json"
# which Megatron layer spec (model.impl) and experts (model.experts) wrote the model and optimizer shards, and the
# optimizer's format (train.checkpoint.optimizer_format)
LEARNER_META = "learner_meta.json"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def tmp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}.tmp"


# ---------------------------------------------------------------------------------- learner side
def rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "megatron": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])


# How the distributed optimizer lays out its shards in a checkpoint (train.checkpoint.optimizer_format): Megatron-LM's
# default dp_reshardable (every DP rank writes its own gradient buckets in parallel; the buckets' layout is the
# parameters' order and shapes, so a resume may change the data-parallel size only) or fully_reshardable (per
# parameter in model space, gathered over data parallelism at each save; each parameter's ShardedTensors as the
# model's, so grouped and sequential experts, whose weights share their keys, load each other's). The
# non-distributed optimizers are model space already. (0.16.1's own default, fully_sharded_model_space, fails
# there: "ShardedTensor.flattened_range is not supported".)
OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable")


def optimizer_metadata(fmt: str) -> dict:
    """Megatron's metadata for the optimizer's sharded state dict in format ``fmt``. fully_reshardable gathers the
    state over data parallelism on the host through Megatron's gloo data-parallel group to DP rank 0, which writes it
    (``distrib_optim_fully_reshardable_mem_efficient``): the other way all-gathers it through the GPUs onto every
    rank's host (a full copy of the model-parallel shard's optimizer state per rank) and needs CUDA."""
    if fmt not in OPTIMIZER_FORMATS:
        raise ValueError(f"train.checkpoint.optimizer_format: {fmt!r} is not one of {OPTIMIZER_FORMATS}")
    return {"distrib_optim_sharding_type": fmt, "distrib_optim_fully_reshardable_mem_efficient": True}


def experts_of(impl: str) -> str:
    """model.experts as a model of parameter layout ``impl`` (``moe.convert.model_impl``) resolved it: sequential,
    grouped or te."""
    return {"local": "sequential", "grouped": "grouped", "te": "te"}[impl]


def _distributed(optimizer) -> bool:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(type(o).__name__ == "DistributedOptimizer" for o in parts)


def save_learner(path: str | Path, module, optimizer, optimizer_format: str = "dp_reshardable") -> None:
    """Collective over the learner ranks: model + optimizer shards (dist-checkpointing, the optimizer in
    ``optimizer_format``) and RNG."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_qarl.moe.parallelize import barrier

    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    barrier()
    allocate_optimizer_state(optimizer)  # a learner saved before its first step
    model_sd = module.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": optimizer.sharded_state_dict(
        model_sd, metadata=optimizer_metadata(optimizer_format))}, str(path))
    torch.save(rng_state(), path / f"rng_rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        meta = {"model_impl": layer_spec_of(model_impl(module)), "experts": experts_of(model_impl(module)),
                "optimizer_format": optimizer_format}
        (path / LEARNER_META).write_text(json.dumps(meta) + "\n")
    barrier()


def read_meta(path: str | Path) -> dict:
    """The learner's record of a checkpoint: layer spec, experts, optimizer format (a checkpoint without a record
    predates them: local spec, sequential experts, dp_reshardable; one without the last two predates the grouped
    experts)."""
    meta_file = Path(path) / LEARNER_META
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {"model_impl": "local"}
    meta.setdefault("experts", "te" if meta["model_impl"] == "te" else "sequential")
    meta.setdefault("optimizer_format", "dp_reshardable")
    return meta


def check_loadable(path: str | Path, impl: str, distributed: bool) -> dict:
    """The checkpoint's record (``read_meta``) when a learner of parameter layout ``impl`` (``moe.convert.model_impl``)
    with a distributed optimizer or not can load it, else UserError naming the keys. The layer specs'
    dist-checkpoint keys differ (the local spec stores an MoE layer's pre-MLP norm under Megatron's
    ``sharded_state_dict_keys_map`` key ``mlp.linear_fc1.layer_norm_weight``, the TE spec under
    ``pre_mlp_layernorm.weight``, and only TE modules carry ``_extra_state``). Sequential and grouped experts share
    their weights' keys (moe/grouped.py); a distributed optimizer's dp_reshardable buckets follow the parameters'
    layout, so they load only into the experts that wrote them."""
    meta = read_meta(path)
    spec, experts = layer_spec_of(impl), experts_of(impl)
    if meta["model_impl"] != spec:
        raise UserError(f"{path}: written by a learner with model.impl={meta['model_impl']!r}, but this learner built "
                        f"model.impl={spec!r}; resume with model.impl={meta['model_impl']} (the two Megatron layer "
                        "specs store different dist-checkpoint keys)")
    if meta["experts"] != experts and distributed and meta["optimizer_format"] == "dp_reshardable":
        raise UserError(f"{path}: written with model.experts={meta['experts']} and "
                        "train.checkpoint.optimizer_format=dp_reshardable (the distributed optimizer's state as "
                        f"gradient buckets, laid out by the {meta['experts']} experts' parameters), but this learner "
                        f"built model.experts={experts}; resume with model.experts={meta['experts']}, or convert "
                        f"once: resume with model.experts={meta['experts']} "
                        "train.checkpoint.optimizer_format=fully_reshardable until the next checkpoint is written, "
                        "which any model.experts loads (docs/training.md, 'Three expert implementations')")
    return meta


def allocate_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer over torch's Adam the state its first step would make, so that it can be
    saved, or a checkpoint loaded into it. Megatron's DistributedOptimizer falls back to torch.optim.AdamW when
    neither Transformer Engine nor Apex is installed (a CPU learner, or a GPU node without TE), and on that path
    builds its state dict (also the one it loads into) from the per-parameter 'step' of the inner optimizer's
    state (distrib_optimizer.py, state_dict: ``assert len(steps) == 1``), which a fresh optimizer does not have
    yet. Allocate Adam's zero moments and step 0, which is where AdamW's first step starts from anyway; a load
    overwrites the moments, ``restore_adam_steps`` the step."""
    from megatron.core.optimizer import distrib_optimizer as do

    if do.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, do.DistributedOptimizer) and not opt.optimizer.state:
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    opt.optimizer.state[p] = {"step": adam_step(0.0, group, p), "exp_avg": torch.zeros_like(p),
                                              "exp_avg_sq": torch.zeros_like(p)}


def restore_adam_steps(optimizer) -> None:
    """After a load on the same fallback path (torch's Adam under Megatron's DistributedOptimizer), set every
    parameter's Adam step count from its parameter group. Megatron stores the step in the groups of the
    checkpoint's common state (torch's Adam keeps one per parameter; TE's FusedAdam, the path Megatron is built
    for, keeps it in the group), and on load (distrib_optimizer.py, load_state_dict) first hands all states one
    shared step tensor, which torch's Adam would then increment once per parameter per step, and then overwrites
    it with the per-parameter 'step' its dp_reshardable bucket state carries, a scalar that format does not
    restore (the loading template's value comes back). A resumed run would drift from the uninterrupted one."""
    from megatron.core.optimizer import distrib_optimizer as do

    if do.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, do.DistributedOptimizer):
            for group in opt.optimizer.param_groups:
                if group.get("step") is None:
                    continue
                for p in group["params"]:
                    if p in opt.optimizer.state:
                        opt.optimizer.state[p]["step"] = adam_step(group["step"], group, p)


def load_learner(path: str | Path, module, optimizer) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = Path(path)
    meta = check_loadable(path, model_impl(module), _distributed(optimizer))
    allocate_optimizer_state(optimizer)
    model_sd = module.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optimizer.sharded_state_dict(
        model_sd, is_loading=True, metadata=optimizer_metadata(meta["optimizer_format"]))}, str(path))
    module.load_state_dict(loaded["model"])
    with torch.no_grad():  # with fp32 parameters the distributed optimizer's shards are views of them, which it
        optimizer.load_state_dict(loaded["optimizer"])  # copies into in place (an autograd error outside no_grad)
    restore_adam_steps(optimizer)
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))


# ----------------------------------------------------------------------------------- driver side
def commit(root: str | Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write the trainer state into the temporary directory, rename it into place, point ``latest`` at
    it and drop all but the newest ``keep`` checkpoints."""
    root = Path(root)
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
    if final.exists():  # the same step saved by an earlier, interrupted attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / "latest")
    for old in sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("step_*.tmp"):  # left by a crash in the middle of a save
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise UserError(f"{pointer}: points at {path}, which is not a complete checkpoint ({STATE_FILE} missing)")
    return path


# ------------------------------------------------------------------------------- checked before a resume
DIST_METADATA = ".metadata"  # torch.distributed.checkpoint's index: every item's file, offset and length
MEGATRON_METADATA = "metadata.json"  # dist-checkpointing's backends


def check_checkpoint(path: str | Path) -> None:
    """UserError naming the file and what is wrong unless every file a resume reads from ``path`` is there and whole,
    read without loading a tensor: the trainer state and the learner's record (JSON), dist-checkpointing's
    ``metadata.json``, torch.distributed.checkpoint's ``.metadata`` (unpickled), and every ``*.distcp`` file it names
    holding at least the last byte it places there (a copy cut short holds fewer), ``common.pt`` and the per-rank
    RNG states (small; loaded)."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_qarl.moe.model_dir import read_json

    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: not a checkpoint folder")
    state = read_json(path / STATE_FILE, "the trainer's state")
    if not isinstance(state, dict) or not isinstance(state.get("trainer"), dict):
        raise UserError(f"{path / STATE_FILE}: no 'trainer' state in it")
    for name in (LEARNER_META, MEGATRON_METADATA):
        if name == MEGATRON_METADATA or (path / name).exists():
            read_json(path / name, "dist-checkpointing's record" if name == MEGATRON_METADATA else "the layer spec")
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as err:  # noqa: BLE001 - any failure to read the index is a corrupt or missing file
        raise UserError(f"{path / DIST_METADATA}: unreadable: {type(err).__name__}: {err}") from None
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        f = path / name
        size = f.stat().st_size if f.is_file() else None
        if size is None or size < end:
            what = "missing" if size is None else f"truncated: {size} bytes"
            raise UserError(f"{f}: {what}, but {DIST_METADATA} places {end} bytes of the checkpoint in it")
    for f in [path / "common.pt", *sorted(path.glob("rng_rank*.pt"))]:
        try:
            torch.load(f, map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001 - a file torch cannot read back, whatever the reason
            raise UserError(f"{f}: unreadable: {type(err).__name__}: {err}") from None


def _older_that_checks_out(root: Path, than: str) -> Path | None:
    """The newest checkpoint under ``root`` named before ``than`` that passes ``check_checkpoint``."""
    for path in sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                        and p.name < than), reverse=True):
        try:
            check_checkpoint(path)
        except UserError:
            continue
        return path
    return None


def resume_point(root: str | Path, requested: bool | str | Path) -> Path:
    """The checkpoint ``qarl train --resume`` continues from, checked before anything is started: the newest under
    ``root`` (``requested`` True) or the folder named. One that is incomplete or corrupt is a UserError naming the
    file, and the newest older checkpoint beside it that checks out (``--resume`` takes it)."""
    root = Path(root)
    if requested is True:
        pointer = root / "latest"
        if not pointer.is_file():
            raise UserError(f"--resume: no checkpoint in {root} (no {pointer.name} file)")
        path = root / pointer.read_text().strip()
    else:
        path = Path(requested)
    try:
        check_checkpoint(path)
    except UserError as err:
        older = _older_that_checks_out(path.parent, path.name)
        hint = (f"the newest older checkpoint that checks out is {older}: continue from it with --resume {older}"
                if older else f"no older checkpoint in {path.parent} checks out")
        raise UserError(f"{err}. Checkpoint {path} is incomplete or corrupt; {hint}") from None
    return path


def read_state(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_FILE).read_text())
