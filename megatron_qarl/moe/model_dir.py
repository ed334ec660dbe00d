"""A Hugging Face model directory as every loader reads it (the learner's ``SafetensorsDir``, the rollout exporter,
the embedded server, ``qarl eval``, ``qarl convert verify``, ``qarl quantize``): its config.json and its weight files,
checked before anything reads a tensor, so that a corrupt or incomplete directory is a UserError naming the file and
what is wrong (exit code 2) instead of a safetensors or transformers traceback.

safetensors' file layout (https://github.com/huggingface/safetensors, README "Format"): 8 bytes N (an unsigned
little-endian 64-bit integer), N bytes of a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {...}}``, then the byte buffer, whose every byte the tensors cover (the library refuses a buffer they
do not: ``MetadataIncompleteBuffer``). So a whole file has exactly

    size = 8 + N + max(end over its tensors)

bytes; fewer is a truncated file (a copy cut short), a header that is no JSON object a corrupt one. Only the headers
are read (a few KiB per shard), never the tensors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from megatron_qarl.errors import UserError
from megatron_qarl.moe.model import Qwen3MoeArch

WEIGHT_INDEX = "model.safetensors.index.json"


def read_json(path: Path, what: str) -> object:
    """The JSON in ``path``; a UserError naming it when it is missing, unreadable or no JSON."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: not found ({what})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: unreadable ({what}): {type(err).__name__}: {err}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: line {err.lineno}: invalid JSON ({what}): {err.msg}") from None


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of ``model_dir``: the shards its index names (each must exist), else every
    ``*.safetensors`` file in it (at least one)."""
    d = Path(model_dir)
    index = d / WEIGHT_INDEX
    if index.exists():
        data = read_json(index, "the index of the weight shards")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or \
                not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{index}: no weight_map of tensor name -> shard file")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise UserError(f"{index}: names {len(missing)} shard(s) that {d} does not hold: {', '.join(missing[:5])}")
        return [d / f for f in files]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise UserError(f"{d}: no *.safetensors weight files (nor a {WEIGHT_INDEX})")
    return files


def safetensors_header(path: Path) -> dict:
    """The JSON header of one safetensors file, after checking that the file holds every byte it describes
    (the module docstring's size); a UserError naming the file and what is wrong otherwise."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            raw = f.read(n) if n is not None and 8 + n <= size else b""
    except OSError as err:
        raise UserError(f"{path}: unreadable: {type(err).__name__}: {err}") from None
    if n is None or 8 + n > size:
        claimed = "" if n is None else f" of {n} bytes"
        raise UserError(f"{path}: truncated or corrupt safetensors file: {size} bytes, too few for its "
                        f"header{claimed}")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: corrupt safetensors header ({n} bytes): {err}") from None
    try:
        end = max([int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"] or [0])
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        raise UserError(f"{path}: corrupt safetensors header: a tensor without data_offsets [begin, end]") from None
    if 8 + n + end != size:
        state = "truncated" if 8 + n + end > size else "corrupt (bytes past its last tensor)"
        raise UserError(f"{path}: {state} safetensors file: its header describes {8 + n + end} bytes, the file "
                        f"holds {size}")
    return header


def check_weights(model_dir: str | Path) -> list[Path]:
    """Every weight file of ``model_dir`` whole (``safetensors_header``), and with an index every tensor it names in
    the shard it names; returns the files."""
    d = Path(model_dir)
    files = weight_files(d)
    held = {f.name: set(safetensors_header(f)) - {"__metadata__"} for f in files}
    index = d / WEIGHT_INDEX
    if index.exists():
        weight_map = read_json(index, "the index of the weight shards")["weight_map"]
        lost = [f"{name} ({shard})" for name, shard in weight_map.items() if name not in held[shard]]
        if lost:
            raise UserError(f"{index}: names {len(lost)} tensor(s) their shard does not hold: {', '.join(lost[:3])}")
    return files


def check_model_dir(model_dir: str | Path) -> Qwen3MoeArch:
    """The whole check of a Qwen3-MoE directory before a loader reads it: config.json (present, readable, JSON, a
    Qwen3-MoE: ``Qwen3MoeArch.from_model_dir``) and every weight file (``check_weights``). Returns the arch."""
    d = Path(model_dir)
    if not d.is_dir():
        raise UserError(f"{d}: not a directory (expected a Hugging Face model directory)")
    arch = Qwen3MoeArch.from_model_dir(d)
    check_weights(d)
    return arch
