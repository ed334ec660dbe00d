"""G samples per prompt from a set of SGLang-protocol servers, with failover.

Every (prompt, sample) pair is one /generate request with its own sampling_seed (derived from the
run seed, the step, the prompt and the sample index, so a rerun draws the same samples). Requests go
to the live server with the fewest in flight. When a server fails (connection refused, timeout, 5xx
after the client's retries) it is marked dead and its unfinished requests are sent again to the others:
no prompt is lost, and ``resent`` counts them. When the last one fails, ``generate`` raises
``EveryServerDown`` and keeps the samples that finished: the caller restarts the servers and calls
``generate`` again with new clients, which sends only the missing requests.

A request that ends with finish_reason ``abort`` (a weight sync paused the servers with SGLang's ``abort`` mode while
it ran) is continued when the manager is asked to (``max_idle_aborts``): its partial output is kept as a segment
and the rest is a new request whose prompt is the original prompt + that output, with the remaining token budget;
the segments are stitched into one Sample (tokens, log-probs, per-token weight versions, and with R3 the routes:
the continuation asks SGLang for the rows of its new positions only, ``routed_experts_start_len`` = its prompt
length - 1). So every segment's routes are those its tokens were sampled under, which SGLang's ``retract`` does
not keep (serve/routed_experts.py). An aborted answer without routes (SGLang answers a request aborted while
queued from its tokenizer manager, without ``routed_experts``) keeps nothing: its tokens are sampled again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from megatron_qarl.algo.routing import RoutesError, decode_routed_experts
from megatron_qarl.rollout.client import RolloutServerError, SGLangClient


class SamplingConfig(BaseModel):
    """How responses are sampled (``rollout.sampling`` in the run config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_samples: int = Field(8, ge=1, description="G: responses per prompt (a GRPO group)")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1: off")
    max_new_tokens: int = Field(48, ge=1)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        # SGLang 0.5.23's SamplingParams.verify: "top_k must be -1 (disable) or at least 1"
        if value != -1 and value < 1:
            raise ValueError("must be -1 (off) or at least 1, as SGLang requires")
        return value

    def params(self, seed: int, stop_token_ids: Sequence[int]) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens, "stop_token_ids": list(stop_token_ids),
                "sampling_seed": seed}


@dataclasses.dataclass
class Sample:
    """One response: token ids and the sampler's log-prob of each (the stop token included)."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logp_sampler: list[float]
    finish_reason: str
    weight_version: str | None
    server: str
    routes: torch.Tensor | None = None  # R3: int32 [prompt + response - 1, layers, top-k] (algo/routing.py)
    # the weight version that sampled each response token (SGLang's meta_info weight_versions spans; a request
    # that spans a weight update has several); None where the server gave no spans (``weight_version`` then)
    token_versions: list[str] | None = None

    def versions(self) -> list[str | None]:
        """Each response token's weight version: the spans', else the answer's ``weight_version`` for all."""
        return list(self.token_versions) if self.token_versions is not None else \
            [self.weight_version] * len(self.response_ids)


@dataclasses.dataclass(frozen=True)
class RoutesSpec:
    """Ask the servers for each sample's routed experts (R3), and what they must look like."""

    layers: int
    topk: int
    num_experts: int


def sample_seed(run_seed: int, step: int, prompt_index: int, sample_index: int, segment: int = 0) -> int:
    """The sampling_seed of a sample's request (``segment`` > 0: the continuation after its segment-th abort)."""
    key = f"{run_seed}:{step}:{prompt_index}:{sample_index}" + (f":{segment}" if segment else "")
    digest = hashlib.blake2b(key.encode(), digest_size=4)
    return int.from_bytes(digest.digest(), "little") & 0x7FFFFFFF


def parse_response(resp: dict, prompt_index: int, sample_index: int, prompt_ids: list[int], server: str,
                   routes: RoutesSpec | None = None, routes_start: int = 0) -> Sample:
    """SGLang's /generate answer -> Sample (token ids from output_token_logprobs: stop token kept; with
    ``routes``, the routed experts of every forwarded position from ``routes_start`` on, checked)."""
    meta = resp["meta_info"]
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise RolloutServerError(f"{server}: /generate answered without output_token_logprobs")
    sample = Sample(prompt_index, sample_index, list(prompt_ids), [int(t[1]) for t in triples],
                    [float(t[0]) for t in triples], meta["finish_reason"]["type"], meta.get("weight_version"), server)
    spans = meta.get("weight_versions")
    if spans:
        sample.token_versions = token_versions(spans, len(sample.response_ids), f"{server}: prompt {prompt_index} "
                                               f"sample {sample_index}")
    if routes is not None:
        where = f"{server}: prompt {prompt_index} sample {sample_index}"
        try:
            seqlen = len(prompt_ids) + len(sample.response_ids)
            sample.routes = decode_routed_experts(meta.get("routed_experts"), seqlen, routes.layers, routes.topk,
                                                  routes.num_experts, where, routes_start)
        except RoutesError as err:  # the server's setup or contract, not a transient failure: not re-sent
            raise RolloutServerError(str(err), status=400) from None
    return sample


def token_versions(spans: list[dict], n: int, where: str) -> list[str]:
    """Per-token weight versions from SGLang's ``meta_info["weight_versions"]``: half-open spans
    ``{"version", "start", "end"}`` that must tile the ``n`` output tokens in order."""
    out: list[str] = []
    for span in spans:
        try:
            version, start, end = str(span["version"]), int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            raise RolloutServerError(f"{where}: malformed weight_versions span {span!r}", status=400) from None
        if start != len(out) or end < start:
            raise RolloutServerError(f"{where}: weight_versions spans {spans} do not tile the output in order",
                                     status=400)
        out += [version] * (end - start)
    if len(out) != n:
        raise RolloutServerError(f"{where}: weight_versions spans cover {len(out)} of {n} output tokens", status=400)
    return out


def stitch(kept: Sample, segment: Sample) -> Sample:
    """``kept`` (the segments so far) followed by ``segment``, the answer to the continuation whose prompt was
    kept's prompt + response: one Sample over the original prompt; the finish reason, version and server are the
    last segment's, the per-token versions and routes (R3) are concatenated."""
    routes = None if kept.routes is None else torch.cat([kept.routes, segment.routes])
    return dataclasses.replace(segment, prompt_ids=kept.prompt_ids, response_ids=kept.response_ids +
                               segment.response_ids, logp_sampler=kept.logp_sampler + segment.logp_sampler,
                               routes=routes, token_versions=kept.versions() + segment.versions())


class EveryServerDown(RolloutServerError):
    """Every server failed during a rollout; the samples that finished are kept for the next ``generate``."""


class RolloutManager:
    """Fans a batch of prompts out to the servers and gathers G samples each."""

    def __init__(self, sampling: SamplingConfig, stop_token_ids: Sequence[int], *, seed: int = 0,
                 routes: RoutesSpec | None = None, max_idle_aborts: int | None = None):
        """``max_idle_aborts``: continue aborted requests (module docstring); a request aborted more than this many
        times in a row without a new token counts as a failure of its server. None: an abort is an answer."""
        self.sampling, self.stop_token_ids, self.seed = sampling, list(stop_token_ids), seed
        self.routes = routes
        self.max_idle_aborts = max_idle_aborts
        self.continued = 0  # continuation requests sent (aborted requests resumed)
        self.finished: dict[tuple[int, int], Sample] = {}  # (prompt, sample) -> its sample, across calls
        self.clients: list[SGLangClient] = []  # this call's servers, with their state:
        self.alive: list[bool] = []
        self.in_flight: list[int] = []
        self.assigned: list[int] = []
        self.resent = 0
        self.server_failures = 0
        self.cancelled = False  # ``cancel``: no call of ``generate`` runs any more
        self._lock = threading.Lock()
        self._running: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None  # the call of generate now

    def cancel(self) -> None:
        """End this manager's requests from another thread, without waiting for them (the trainer's pipeline after
        an error or a stop signal): a call of ``generate`` running now ends with asyncio.CancelledError as soon as
        its event loop runs, its HTTP requests closed (SGLang and vLLM abort a request whose client disconnected);
        a later call raises it at once."""
        with self._lock:
            self.cancelled = True
            if self._running is not None:
                loop, task = self._running
                loop.call_soon_threadsafe(task.cancel)

    def _pick(self) -> int:
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise EveryServerDown("rollout: every server is down")
        i = min(live, key=lambda i: (self.in_flight[i], self.assigned[i]))  # ties: the least used so far
        self.assigned[i] += 1
        return i

    def _fail(self, i: int) -> None:
        if self.alive[i]:
            self.alive[i] = False
            self.server_failures += 1

    async def _one(self, step: int, p: int, j: int, prompt_ids: list[int]) -> None:
        kept: Sample | None = None  # the segments so far of a request that was aborted and is being continued
        idle = 0  # aborts in a row without a new token
        resumed = 0  # continuations sent for this sample
        while True:
            i = self._pick()
            self.in_flight[i] += 1
            try:
                segment = await self._segment(i, sample_seed(self.seed, step, p, j, resumed), p, j, prompt_ids, kept)
            except RolloutServerError as err:
                if err.status is not None and err.status < 500:
                    raise  # our request is wrong: re-sending cannot help
                self._fail(i)
                self.resent += 1
                continue
            finally:
                self.in_flight[i] -= 1
            if segment is not None and (segment.finish_reason != "abort" or self.max_idle_aborts is None):
                self.finished[(p, j)] = segment if kept is None else stitch(kept, segment)
                return
            if segment is not None and segment.response_ids:
                kept, idle = (segment if kept is None else stitch(kept, segment)), 0
                if self._complete(kept):
                    self.finished[(p, j)] = kept
                    return
            else:
                idle += 1
                if idle > self.max_idle_aborts:  # not syncs: a server that aborts everything
                    self._fail(i)
                    self.resent += 1
                    idle = 0
            resumed += 1
            self.continued += 1

    async def _segment(self, i: int, seed: int, p: int, j: int, prompt_ids: list[int],
                       kept: Sample | None) -> Sample | None:
        """One /generate to server ``i``: the sample, or with ``kept`` the continuation after its response so far.
        None: an aborted answer that keeps nothing (no routes where routes are wanted)."""
        done = kept.response_ids if kept is not None else []
        params = self.sampling.params(seed, self.stop_token_ids)
        params["max_new_tokens"] -= len(done)
        start = len(prompt_ids) + len(done) - 1 if done else 0  # R3: the rows of the new positions only
        extra = {}
        if self.routes is not None:
            extra = {"return_routed_experts": True, **({"routed_experts_start_len": start} if done else {})}
        resp = await self.clients[i].generate(prompt_ids + done, params, return_logprob=True, **extra)
        meta = resp["meta_info"]
        if (self.max_idle_aborts is not None and self.routes is not None and meta.get("routed_experts") is None
                and meta["finish_reason"]["type"] == "abort"):
            return None
        return parse_response(resp, p, j, prompt_ids + done, self.clients[i].url, self.routes, start)

    def _complete(self, kept: Sample) -> bool:
        """An aborted request whose kept output already ends with a stop token or fills the budget is done (SGLang
        checks an abort before the stop token it sampled in the same step)."""
        if kept.response_ids[-1] in self.stop_token_ids:
            kept.finish_reason = "stop"
        elif len(kept.response_ids) >= self.sampling.max_new_tokens:
            kept.finish_reason = "length"
        return kept.finish_reason != "abort"

    async def generate(self, clients: Sequence[SGLangClient], prompts: Sequence[list[int]],
                       step: int) -> list[list[Sample]]:
        """G samples for every prompt from ``clients`` (the live servers), grouped per prompt in order.

        Sends only the requests no earlier call finished. Raises ``EveryServerDown`` when every client failed
        (after every request has either finished or found no server left), or the first other error."""
        if not clients:
            raise ValueError("rollout: at least one server is needed")
        with self._lock:
            if self.cancelled:
                raise asyncio.CancelledError("rollout: cancelled")
            self._running = (asyncio.get_running_loop(), asyncio.current_task())
        try:
            return await self._generate(clients, prompts, step)
        finally:
            with self._lock:
                self._running = None

    async def _generate(self, clients: Sequence[SGLangClient], prompts: Sequence[list[int]],
                        step: int) -> list[list[Sample]]:
        self.clients, self.alive = list(clients), [True] * len(clients)
        self.in_flight, self.assigned = [0] * len(clients), [0] * len(clients)
        n = self.sampling.n_samples
        todo = [(p, j) for p in range(len(prompts)) for j in range(n) if (p, j) not in self.finished]
        results = await asyncio.gather(*(self._one(step, p, j, prompts[p]) for p, j in todo), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise next((e for e in errors if not isinstance(e, EveryServerDown)), errors[0])
        return [[self.finished[(p, j)] for j in range(n)] for p in range(len(prompts))]
