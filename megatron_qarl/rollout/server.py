"""``qarl serve``: the embedded engine behind SGLang's native HTTP API (the subset RL trainers use).

The field names, defaults and response shapes follow SGLang (docs/rollout.md, which cites the SGLang source
files they were read from), so one rollout client drives a real SGLang fleet and this CPU server alike.
Security: the server binds 127.0.0.1 by default. On any other host it refuses to start without an
API key; with a key, every endpoint but GET /health needs ``Authorization: Bearer <key>`` (as SGLang's
``--api-key``), which in particular guards the admin and weight-update endpoints.
Bad input (unknown token ids, a length beyond the context, an empty prompt, malformed JSON, unknown
fields) is a 4xx with a message; it never reaches the engine thread.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from megatron_qarl import wire
from megatron_qarl.errors import UserError
from megatron_qarl.moe.parallelize import broadcast, group_empty
from megatron_qarl.qat.export import iter_safetensors
from megatron_qarl.rollout.engine import Engine, EngineConfig, SamplingParams, in_fresh_thread
from megatron_qarl.sync import delta
from megatron_qarl.sync.checksum import engine_checksum, overall_checksum, weight_checksums

# SGLang 0.5.23's answers, word for word (sglang/srt/managers/scheduler_components/weight_updater.py)
OUTSIDE_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
                   "end_weight_update()")
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=0, le=65535)
    api_key: str | None = None

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


_BEARER = HTTPBearer(auto_error=False)  # module level: FastAPI resolves the annotation from the globals


# ---------------------------------------------------------------------------------------------- requests
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateReq(_Body):
    """POST /generate. One prompt (flat ``input_ids`` / a string ``text``) or a batch (lists of them)."""

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(default=-1, ge=-1)
    rid: str | list[str] | None = None
    stream: Literal[False] = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # routes of positions [start, seqlen - 1); SGLang aborts < 0 or > prompt


class PauseReq(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


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


def _bad(message: str, status: int = 400) -> HTTPException:
    return HTTPException(status_code=status, detail=message)


def _tokenizer(model_path: str):
    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


# -------------------------------------------------------------------------------------------------- app
def build_app(engine: Engine, cfg: ServerConfig) -> FastAPI:
    """The FastAPI app around a running engine. Raises UserError for an unsafe host/key combination."""
    if not cfg.loopback and not cfg.api_key:
        raise UserError(f"--host {cfg.host} is not a loopback address: --api-key is required "
                        "(the admin and weight-update endpoints must not be open to the network)")
    app = FastAPI(title="qarl embedded rollout server (SGLang native API subset)")
    tokenizer = _tokenizer(engine.cfg.model_path)
    groups: dict[str, Any] = {}
    state = {"model_path": engine.cfg.model_path}
    session: dict[str, Any] = {"open": False}  # the weight-update session (one at a time, as SGLang's)
    session_lock = threading.Lock()

    def auth(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]) -> None:
        if cfg.api_key and (creds is None or creds.credentials != cfg.api_key):
            raise HTTPException(status_code=401, detail="missing or wrong API key (Authorization: Bearer <key>)")

    guarded = [Depends(auth)]

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, err: ValueError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"error": {"message": str(err)}})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info", dependencies=guarded)
    async def get_model_info() -> dict:
        m = engine.model
        return {"model_path": state["model_path"], "tokenizer_path": state["model_path"], "is_generation": True,
                "weight_version": engine.weight_version, "quantization": m.scheme, "dtype": engine.cfg.dtype,
                "max_context_length": engine.max_seq_len, "vocab_size": engine.vocab_size,
                "max_batch_size": m.slots}

    @app.post("/generate", dependencies=guarded)
    async def generate(body: GenerateReq) -> Any:
        prompts, batched = _prompts(body, tokenizer)
        params = body.sampling_params or SamplingParams()
        if isinstance(params, list) and len(params) != len(prompts):
            raise _bad(f"sampling_params: {len(params)} entries for {len(prompts)} prompts")
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
        if len(rids) != len(prompts):
            raise _bad(f"rid: {len(rids)} entries for {len(prompts)} prompts")
        loop = asyncio.get_running_loop()
        futures, reqs = [], []
        for i, ids in enumerate(prompts):
            fut = loop.create_future()
            kw = {"rid": rids[i]} if rids[i] is not None else {}
            req = engine.make_request(ids, params[i] if isinstance(params, list) else params,
                                      return_logprob=body.return_logprob, logprob_start_len=body.logprob_start_len,
                                      return_routed_experts=body.return_routed_experts,
                                      routed_experts_start_len=body.routed_experts_start_len,
                                      on_done=lambda r, f=fut: loop.call_soon_threadsafe(_resolve, f, r), **kw)
            futures.append(fut)
            reqs.append(req)
        for req in reqs:  # validated all before submitting any
            engine.submit(req)
        done = await asyncio.gather(*futures)
        out = [_response(r, body, tokenizer, engine) for r in done]
        return out if batched else out[0]

    @app.post("/flush_cache", dependencies=guarded)
    async def flush_cache() -> Response:
        pending = engine.num_pending()
        if pending:
            return Response(f"Cache not flushed: {pending} request(s) pending\n", status_code=400)
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/pause_generation", dependencies=guarded)
    async def pause_generation(body: PauseReq | None = None) -> dict:
        n = await asyncio.to_thread(engine.pause, (body or PauseReq()).mode)
        return {"success": True, "message": f"paused ({(body or PauseReq()).mode})", "num_paused_requests": n}

    @app.post("/continue_generation", dependencies=guarded)
    async def continue_generation() -> dict:
        engine.resume()
        return {"success": True, "message": "continued"}

    @app.post("/update_weights_from_disk", dependencies=guarded)
    def update_weights_from_disk(body: UpdateFromDiskReq) -> JSONResponse:
        n = engine.num_pending()
        try:
            if body.load_format not in (None, "auto", "safetensors"):
                raise ValueError(f"load_format {body.load_format!r}: only safetensors checkpoints are read")
            if not (Path(body.model_path) / "config.json").is_file():
                raise ValueError(f"{body.model_path}: not a model directory (no config.json)")
            if body.abort_all_requests:
                engine.abort_all("aborted by update_weights_from_disk")
            tensors = in_fresh_thread(lambda: dict(iter_safetensors(body.model_path)))  # see in_fresh_thread
            engine.update_tensors(tensors, body.weight_version)
        except (ValueError, OSError) as err:
            return JSONResponse({"success": False, "message": str(err), "num_paused_requests": n}, 400)
        state["model_path"] = body.model_path
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                             "num_paused_requests": n})

    @app.post("/init_weights_update_group", dependencies=guarded)
    def init_weights_update_group(body: InitGroupReq) -> JSONResponse:
        if body.group_name in groups:
            return JSONResponse({"success": False, "message": f"group {body.group_name!r} exists"}, 400)
        if body.rank_offset >= body.world_size:
            return JSONResponse({"success": False, "message": "rank_offset must be < world_size"}, 400)
        backend = "gloo" if body.backend == "nccl" and not torch.cuda.is_available() else body.backend
        try:
            groups[body.group_name] = wire.init_custom_process_group(
                backend, f"tcp://{body.master_address}:{body.master_port}", body.world_size, body.rank_offset,
                body.group_name)
        except Exception as err:  # noqa: BLE001 - a failed rendezvous is the caller's problem, reported
            return JSONResponse({"success": False, "message": f"{type(err).__name__}: {err}"}, 400)
        return JSONResponse({"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"
                             f" of {body.world_size} ({backend})"})

    def _answer(success: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": success, "message": message}, 200 if success else 400)

    @app.post("/begin_weight_update", dependencies=guarded)
    def begin_weight_update(body: BeginWeightUpdateReq | None = None) -> JSONResponse:
        """Open the session. Our store keeps checkpoint-format tensors, so there is nothing to restore
        (SGLang restores in-place-packed weights here)."""
        with session_lock:
            if session["open"]:
                return _answer(False, SESSION_OPEN)
            session["open"] = True
        return _answer(True, "Success")

    @app.post("/end_weight_update", dependencies=guarded)
    def end_weight_update(body: EndWeightUpdateReq | None = None) -> JSONResponse:
        """Close the session: the low-bit layers loaded in it are repacked / prepacked now, once."""
        with session_lock:
            if not session["open"]:
                return _answer(False, NO_SESSION)
            try:
                engine.finalize_weights()
            finally:
                session["open"] = False
        return _answer(True, "Success")

    @app.post("/update_weights_from_distributed", dependencies=guarded)
    def update_weights_from_distributed(body: UpdateFromDistributedReq) -> JSONResponse:
        """SGLang's order: refuse outside a session or without the group (before receiving anything); else
        receive the whole bucket, then load it (a refusal after that leaves no broadcast pending).
        ``load_format="delta"`` (ours, not SGLang's): the bucket holds changed blocks, applied in place into the
        held tensors (sync/delta.py; docs/rollout.md, 'Delta weight sync')."""
        if not session["open"]:
            return _answer(False, OUTSIDE_SESSION)
        pg = groups.get(body.group_name)
        if pg is None:
            return _answer(False, f"Failed to receive weights: Group {body.group_name} not in {list(groups)}. "
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
        try:
            if body.abort_all_requests:
                engine.abort_all("aborted by update_weights_from_distributed")
            if body.load_format == delta.LOAD_FORMAT:  # changed blocks only, into the held tensors in place
                engine.apply_deltas(delta.pair_parts(received), body.weight_version)
            else:
                engine.load_tensors(received, body.weight_version)
        except ValueError as err:
            return _answer(False, f"Failed to update parameter online: {err}. The full weights of the ModelRunner "
                                  "are partially updated. Please discard the whole weights.")
        if body.flush_cache and engine.num_pending():
            return _answer(False, NOT_FLUSHED)
        return _answer(True, "Succeeded to update parameter online.")

    @app.post("/update_weight_version", dependencies=guarded)
    def update_weight_version(body: UpdateWeightVersionReq) -> JSONResponse:
        if body.abort_all_requests:
            engine.abort_all("aborted by update_weight_version")
        engine.set_weight_version(body.new_version)
        return JSONResponse({"success": True, "message": f"Weight version updated to {body.new_version}",
                             "new_version": body.new_version})

    @app.post("/destroy_weights_update_group", dependencies=guarded)
    def destroy_weights_update_group(body: DestroyGroupReq | None = None) -> JSONResponse:
        name = (body or DestroyGroupReq()).group_name
        pg = groups.pop(name, None)
        if pg is None:
            return JSONResponse({"success": False, "message": f"no weight update group {name!r}"}, 400)
        wire.destroy_process_group(pg)
        return JSONResponse({"success": True, "message": f"destroyed {name}"})

    @app.post("/weights_checker", dependencies=guarded)
    def weights_checker(body: CheckWeightsReq | None = None) -> JSONResponse:
        """SGLang's checksum (megatron_qarl/sync/checksum.py) of every held tensor, one rank, in SGLang's
        response shape; the other actions (snapshot / compare / reset_tensors) are not served here."""
        body = body or CheckWeightsReq()
        if body.action != "checksum":
            return _answer(False, f"Unsupported action={body.action!r} (this server serves 'checksum')")
        skip = body.skip_tensor_list or ()
        with engine.lock:
            held = {n: t for n, t in engine.model.store.items() if not any(p in n for p in skip)}
            checksums = weight_checksums(held)
        per_gpu = overall_checksum(checksums)
        rank = {"checksums": checksums, "per_gpu_checksum": per_gpu, "parallelism_info": {
            "role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
            "rank": 0, "size": 1}}
        return JSONResponse({"success": True, "message": "Success.", "ranks": [rank],
                             "per_engine_checksum": engine_checksum([per_gpu])})

    app.get("/weights_checker", dependencies=guarded, operation_id="weights_checker_get")(weights_checker)

    return app


def _resolve(fut: asyncio.Future, req) -> None:
    if not fut.done():
        fut.set_result(req)


def _prompts(body: GenerateReq, tokenizer) -> tuple[list[list[int]], bool]:
    """(prompts as token ids, whether the input was a batch)."""
    if (body.input_ids is None) == (body.text is None):
        raise _bad("give exactly one of input_ids and text")
    if body.text is not None:
        if tokenizer is None:
            raise _bad("text input needs tokenizer.json in the model directory; send input_ids")
        texts = body.text if isinstance(body.text, list) else [body.text]
        prompts = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
        batched = isinstance(body.text, list)
    else:
        ids = body.input_ids
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
    if not prompts:
        raise _bad("empty batch")
    return prompts, batched


def _response(req, body: GenerateReq, tokenizer, engine: Engine) -> dict:
    text = ""
    if tokenizer is not None:
        ids = req.output_ids
        if req.finish_reason.get("type") == "stop" and not req.params.no_stop_trim:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
    meta = {"id": req.rid, "finish_reason": req.finish_reason, "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids), "cached_tokens": 0, "weight_version": req.weight_version,
            "e2e_latency": time.monotonic() - req.created}
    if body.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.output_logprobs, req.output_ids,
                                                                        strict=True)]
        start = max(body.logprob_start_len, 0)
        meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.input_logprobs,
                                                                       req.prompt_ids[start:], strict=False)]
    if req.return_routed_experts:  # SGLang's encoding: base64 of the int32 [rows, layers, top-k] tensor's bytes
        meta["routed_experts"] = base64.b64encode(engine.routed_experts(req).numpy().tobytes()).decode("utf-8")
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


# --------------------------------------------------------------------------------------------------- CLI
def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a Qwen3-MoE checkpoint (bf16 or qat/ export) over SGLang's API")
    p.add_argument("--model", required=True, help="Hugging Face model dir (bf16/fp32 or w4a16/w8a8 export)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="required when --host is not loopback")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="answer return_routed_experts requests (SGLang's flag; routing replay, R3)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of the engine (default: torch's, one per core); on a machine shared with "
                        "a learner, fewer threads avoid OpenMP stalls when a core is taken (BENCHMARKS.md)")
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    import uvicorn

    from megatron_qarl.errors import ConfigError

    server_cfg = ServerConfig(host=args.host, port=args.port, api_key=args.api_key)
    if not server_cfg.loopback and not server_cfg.api_key:
        raise UserError(f"--host {args.host} is not loopback: --api-key is required")
    if not (Path(args.model) / "config.json").is_file():
        raise ConfigError(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
    try:
        engine = Engine(EngineConfig(model_path=args.model, dtype=args.dtype, max_batch_size=args.max_batch_size,
                                     max_seq_len=args.max_seq_len, num_threads=args.num_threads,
                                     enable_return_routed_experts=args.enable_return_routed_experts))
    except (KeyError, ValueError, json.JSONDecodeError) as err:
        raise UserError(f"--model {args.model}: {err}") from None
    app = build_app(engine, server_cfg)
    try:
        uvicorn.run(app, host=server_cfg.host, port=server_cfg.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0
