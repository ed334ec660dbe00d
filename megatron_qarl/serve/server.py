"""``qarl serve``: the embedded engine behind SGLang's native HTTP API (the subset RL trainers use).

This module: the app, its API key, and the generation and admin routes (/health, /get_model_info, /generate,
/flush_cache, /pause_generation, /continue_generation). The weight-update routes are serve/weight_receiver.py's,
the command line serve/cli.py's.

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
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from megatron_qarl.errors import UserError
from megatron_qarl.serve import routed_experts
from megatron_qarl.serve.engine import Engine
from megatron_qarl.serve.request import SamplingParams, weight_version_spans
from megatron_qarl.serve.weight_receiver import WeightReceiver


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
    receiver = WeightReceiver(engine)  # the weight-update endpoints (serve/weight_receiver.py)

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
        return {"model_path": receiver.model_path, "tokenizer_path": receiver.model_path, "is_generation": True,
                "weight_version": engine.weights.version, "quantization": m.scheme, "dtype": engine.cfg.dtype,
                "max_context_length": engine.max_seq_len, "vocab_size": engine.vocab_size,
                "max_batch_size": m.slots}

    @app.post("/generate", dependencies=guarded)
    async def generate(body: GenerateReq) -> Any:
        return await _generate(engine, tokenizer, body)

    @app.post("/flush_cache", dependencies=guarded)
    async def flush_cache() -> Response:
        pending = engine.scheduler.num_unflushable()  # SGLang: running ones, and waiting ones unless paused
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

    app.include_router(receiver.router(guarded))
    return app


async def _generate(engine: Engine, tokenizer, body: GenerateReq) -> Any:
    """POST /generate: every prompt validated (a 400 names the problem) before any is submitted; the answers
    once all are done, one dict or a list for a batch."""
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
    # weight_versions: the output's token ranges per weight version (a request that spans a weight update has
    # several) and weight_version the last one's, as SGLang's add_weight_versions_to_meta_info
    spans = weight_version_spans(req.version_events, req.weight_version, len(req.output_ids))
    meta = {"id": req.rid, "finish_reason": req.finish_reason, "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids), "cached_tokens": 0, "weight_version": spans[-1]["version"],
            "weight_versions": spans, "num_retractions": req.num_retractions,
            "e2e_latency": time.monotonic() - req.created}
    if body.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.output_logprobs, req.output_ids,
                                                                        strict=True)]
        start = max(body.logprob_start_len, 0)
        meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.input_logprobs,
                                                                       req.prompt_ids[start:], strict=False)]
    if routed_experts.has_routes(req):  # SGLang's encoding: base64 of the int32 [rows, layers, top-k] tensor's bytes
        meta["routed_experts"] = base64.b64encode(engine.routed_experts(req).numpy().tobytes()).decode("utf-8")
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
