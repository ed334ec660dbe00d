"""The embedded server's side of SGLang's weight-update protocol: the update groups, the weight-update session,
loading buckets (full or delta) and disk checkpoints, naming versions, and the checksums of what it holds.

Field names, answers and refusals follow SGLang 0.5.23 (sglang/srt/entrypoints/http_server.py,
sglang/srt/managers/io_struct.py, sglang/srt/managers/scheduler_components/weight_updater.py); the trainer's side
is megatron_qarl/sync/weight_update.py. ``load_format="delta"`` is ours (sync/delta.py; docs/rollout.md, 'Delta
weight sync').
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from megatron_qarl import wire
from megatron_qarl.errors import UserError
from megatron_qarl.moe.parallelize import broadcast, group_empty
from megatron_qarl.qat.export import iter_safetensors
from megatron_qarl.serve.engine import Engine
from megatron_qarl.serve.weight_loading import in_fresh_thread
from megatron_qarl.sync import delta
from megatron_qarl.sync.checksum import engine_checksum, overall_checksum, weight_checksums

# SGLang 0.5.23's answers, word for word (sglang/srt/managers/scheduler_components/weight_updater.py)
OUTSIDE_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
                   "end_weight_update()")
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpdateFromDiskReq(_Body):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False


class InitGroupReq(_Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"


Selector = Literal["target", "draft", "all"]  # SGLang's runner selector (a draft model: speculative decoding)


class UpdateFromDistributedReq(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | None = None
    load_format: str | None = None
    abort_all_requests: bool = False
    selector: Selector = "all"
    torch_empty_cache: bool = False
    rid: str | None = None


class BeginWeightUpdateReq(_Body):
    """POST /begin_weight_update: opens the session the updates must run in (SGLang 0.5.23)."""

    selector: Selector = "all"
    rid: str | None = None


class EndWeightUpdateReq(_Body):
    """POST /end_weight_update: finalizes what the session loaded (repack / prepack) and closes it."""

    rid: str | None = None


class CheckWeightsReq(_Body):
    """POST /weights_checker (SGLang's CheckWeightsReqInput); only ``checksum`` is served here."""

    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Selector = "all"
    rid: str | None = None


class UpdateWeightVersionReq(_Body):
    """POST /update_weight_version: name the held weights anew without changing them (SGLang's
    UpdateWeightVersionReqInput)."""

    new_version: str
    abort_all_requests: bool = True
    rid: str | None = None


class DestroyGroupReq(_Body):
    group_name: str = "weight_update_group"


def _answer(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message}, 200 if success else 400)


class WeightReceiver:
    """One engine's weight-update endpoints: its groups (by name), its one session, the model path it serves."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.model_path = engine.cfg.model_path  # moves with /update_weights_from_disk (/get_model_info reports it)
        self.groups: dict[str, Any] = {}
        self.session_open = False  # one at a time, as SGLang's
        self.session_lock = threading.Lock()

    def router(self, dependencies: list) -> APIRouter:
        """The routes, each guarded by ``dependencies`` (the API key)."""
        router = APIRouter(dependencies=dependencies)
        for path, handler in (("/update_weights_from_disk", self.update_weights_from_disk),
                              ("/init_weights_update_group", self.init_weights_update_group),
                              ("/begin_weight_update", self.begin_weight_update),
                              ("/end_weight_update", self.end_weight_update),
                              ("/update_weights_from_distributed", self.update_weights_from_distributed),
                              ("/update_weight_version", self.update_weight_version),
                              ("/destroy_weights_update_group", self.destroy_weights_update_group)):
            router.add_api_route(path, handler, methods=["POST"])
        router.add_api_route("/weights_checker", self.weights_checker, methods=["POST"])
        router.add_api_route("/weights_checker", self.weights_checker, methods=["GET"],
                             operation_id="weights_checker_get")
        return router

    # ------------------------------------------------------------------------------------ disk
    def update_weights_from_disk(self, body: UpdateFromDiskReq) -> JSONResponse:
        engine = self.engine
        n = engine.scheduler.num_pending()
        try:
            if body.load_format not in (None, "auto", "safetensors"):
                raise ValueError(f"load_format {body.load_format!r}: only safetensors checkpoints are read")
            if not (Path(body.model_path) / "config.json").is_file():
                raise ValueError(f"{body.model_path}: not a model directory (no config.json)")
            if body.abort_all_requests:
                engine.abort_all("aborted by update_weights_from_disk")
            tensors = in_fresh_thread(lambda: dict(iter_safetensors(body.model_path)))  # see in_fresh_thread
            engine.weights.update_tensors(tensors, body.weight_version)
        except (ValueError, OSError, UserError) as err:  # UserError: a corrupt or incomplete model directory
            return JSONResponse({"success": False, "message": str(err), "num_paused_requests": n}, 400)
        self.model_path = body.model_path
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                             "num_paused_requests": n})

    # ----------------------------------------------------------------------------------- groups
    def init_weights_update_group(self, body: InitGroupReq) -> JSONResponse:
        if body.group_name in self.groups:
            return JSONResponse({"success": False, "message": f"group {body.group_name!r} exists"}, 400)
        if body.rank_offset >= body.world_size:
            return JSONResponse({"success": False, "message": "rank_offset must be < world_size"}, 400)
        backend = "gloo" if body.backend == "nccl" and not torch.cuda.is_available() else body.backend
        try:
            self.groups[body.group_name] = wire.init_custom_process_group(
                backend, f"tcp://{body.master_address}:{body.master_port}", body.world_size, body.rank_offset,
                body.group_name)
        except Exception as err:  # noqa: BLE001 - a failed rendezvous is the caller's problem, reported
            return JSONResponse({"success": False, "message": f"{type(err).__name__}: {err}"}, 400)
        return JSONResponse({"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"
                             f" of {body.world_size} ({backend})"})

    def destroy_weights_update_group(self, body: DestroyGroupReq | None = None) -> JSONResponse:
        name = (body or DestroyGroupReq()).group_name
        pg = self.groups.pop(name, None)
        if pg is None:
            return JSONResponse({"success": False, "message": f"no weight update group {name!r}"}, 400)
        wire.destroy_process_group(pg)
        return JSONResponse({"success": True, "message": f"destroyed {name}"})

    # ---------------------------------------------------------------------------------- session
    def begin_weight_update(self, body: BeginWeightUpdateReq | None = None) -> JSONResponse:
        """Open the session. Our store keeps checkpoint-format tensors, so there is nothing to restore
        (SGLang restores in-place-packed weights here)."""
        with self.session_lock:
            if self.session_open:
                return _answer(False, SESSION_OPEN)
            self.session_open = True
        return _answer(True, "Success")

    def end_weight_update(self, body: EndWeightUpdateReq | None = None) -> JSONResponse:
        """Close the session: the low-bit layers loaded in it are repacked / prepacked now, once."""
        with self.session_lock:
            if not self.session_open:
                return _answer(False, NO_SESSION)
            try:
                self.engine.weights.finalize()
            finally:
                self.session_open = False
        return _answer(True, "Success")

    def update_weights_from_distributed(self, body: UpdateFromDistributedReq) -> JSONResponse:
        """SGLang's order: refuse outside a session or without the group (before receiving anything); else
        receive the whole bucket, then load it (a refusal after that leaves no broadcast pending).
        ``load_format="delta"`` (ours, not SGLang's): the bucket holds changed blocks, applied in place into the
        held tensors (sync/delta.py; docs/rollout.md, 'Delta weight sync')."""
        if not self.session_open:
            return _answer(False, OUTSIDE_SESSION)
        pg = self.groups.get(body.group_name)
        if pg is None:
            return _answer(False, f"Failed to receive weights: Group {body.group_name} not in {list(self.groups)}. "
                                  "Please call `init_weights_update_group` first.")
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            return _answer(False, "names, dtypes, shapes differ in length")
        if body.load_format not in (None, "direct", delta.LOAD_FORMAT):
            return _answer(False, f"load_format {body.load_format!r} unsupported (None, 'direct' or "
                                  f"{delta.LOAD_FORMAT!r}: docs/rollout.md, 'Delta weight sync')")
        try:
            dtypes = [wire.parse_dtype(d) for d in body.dtypes]
        except ValueError as err:
            return _answer(False, str(err))
        received = {}
        for name, dtype, shape in zip(body.names, dtypes, body.shapes, strict=True):  # the trainer's order
            t = group_empty(shape, dtype, pg)  # on the group's device: NCCL receives into GPU memory only
            broadcast(t, 0, pg, name=name)
            received[name] = t.cpu()  # the engine computes on the CPU
        return self._load(body, received)

    def _load(self, body: UpdateFromDistributedReq, received: dict[str, torch.Tensor]) -> JSONResponse:
        engine = self.engine
        try:
            if body.abort_all_requests:
                engine.abort_all("aborted by update_weights_from_distributed")
            if body.load_format == delta.LOAD_FORMAT:  # changed blocks only, into the held tensors in place
                engine.weights.apply_deltas(delta.pair_parts(received), body.weight_version)
            else:
                engine.weights.load_tensors(received, body.weight_version)
        except ValueError as err:
            return _answer(False, f"{wire.LOAD_FAILED}: {err}. The full weights of the ModelRunner "
                                  "are partially updated. Please discard the whole weights.")
        # SGLang's flush: the waiting requests of a paused engine (retracted ones) do not count
        if body.flush_cache and engine.scheduler.num_unflushable():
            return _answer(False, wire.NOT_FLUSHED)
        return _answer(True, "Succeeded to update parameter online.")

    def update_weight_version(self, body: UpdateWeightVersionReq) -> JSONResponse:
        if body.abort_all_requests:
            self.engine.abort_all("aborted by update_weight_version")
        self.engine.weights.set_version(body.new_version)
        return JSONResponse({"success": True, "message": f"Weight version updated to {body.new_version}",
                             "new_version": body.new_version})

    # ------------------------------------------------------------------------------------ check
    def weights_checker(self, body: CheckWeightsReq | None = None) -> JSONResponse:
        """SGLang's checksum (megatron_qarl/sync/checksum.py) of every held tensor, one rank, in SGLang's
        response shape; the other actions (snapshot / compare / reset_tensors) are not served here."""
        body = body or CheckWeightsReq()
        if body.action != "checksum":
            return _answer(False, f"Unsupported action={body.action!r} (this server serves 'checksum')")
        skip = body.skip_tensor_list or ()
        with self.engine.lock:
            held = {n: t for n, t in self.engine.model.store.items() if not any(p in n for p in skip)}
            checksums = weight_checksums(held)
        per_gpu = overall_checksum(checksums)
        rank = {"checksums": checksums, "per_gpu_checksum": per_gpu, "parallelism_info": {
            "role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
            "rank": 0, "size": 1}}
        return JSONResponse({"success": True, "message": "Success.", "ranks": [rank],
                             "per_engine_checksum": engine_checksum([per_gpu])})
