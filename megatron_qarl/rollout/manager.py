"""G samples per prompt from a set of SGLang-protocol servers, with failover.

Every (prompt, sample) pair is one /generate request with its own sampling_seed (derived from the
run seed, the step, the prompt and the sample index, so a rerun draws the same samples). Requests go
to the live server with the fewest in flight. When a server fails (connection refused, timeout, 5xx
after the client's retries) it is marked dead and its unfinished requests are sent again to the others:
no prompt is lost, and ``resent`` counts them. When the last one fails, ``generate`` raises
``EveryServerDown`` and keeps the samples that finished: the caller restarts the servers and calls
``generate`` again with new clients, which sends only the missing requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
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


def sample_seed(run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    digest = hashlib.blake2b(f"{run_seed}:{step}:{prompt_index}:{sample_index}".encode(), digest_size=4)
    return int.from_bytes(digest.digest(), "little") & 0x7FFFFFFF


def parse_response(resp: dict, prompt_index: int, sample_index: int, prompt_ids: list[int], server: str,
                   routes: RoutesSpec | None = None) -> Sample:
    """SGLang's /generate answer -> Sample (token ids from output_token_logprobs: stop token kept; with
    ``routes``, the routed experts of every forwarded position, checked)."""
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
                                                  routes.num_experts, where)
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


class EveryServerDown(RolloutServerError):
    """Every server failed during a rollout; the samples that finished are kept for the next ``generate``."""


class RolloutManager:
    """Fans a batch of prompts out to the servers and gathers G samples each."""

    def __init__(self, sampling: SamplingConfig, stop_token_ids: Sequence[int], *, seed: int = 0,
                 routes: RoutesSpec | None = None):
        self.sampling, self.stop_token_ids, self.seed = sampling, list(stop_token_ids), seed
        self.routes = routes
        self.finished: dict[tuple[int, int], Sample] = {}  # (prompt, sample) -> its sample, across calls
        self.clients: list[SGLangClient] = []  # this call's servers, with their state:
        self.alive: list[bool] = []
        self.in_flight: list[int] = []
        self.assigned: list[int] = []
        self.resent = 0
        self.server_failures = 0

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
        params = self.sampling.params(sample_seed(self.seed, step, p, j), self.stop_token_ids)
        while True:
            i = self._pick()
            self.in_flight[i] += 1
            try:
                extra = {"return_routed_experts": True} if self.routes is not None else {}
                resp = await self.clients[i].generate(prompt_ids, params, return_logprob=True, **extra)
                self.finished[(p, j)] = parse_response(resp, p, j, prompt_ids, self.clients[i].url, self.routes)
                return
            except RolloutServerError as err:
                if err.status is not None and err.status < 500:
                    raise  # our request is wrong: re-sending cannot help
                self._fail(i)
                self.resent += 1
            finally:
                self.in_flight[i] -= 1

    async def generate(self, clients: Sequence[SGLangClient], prompts: Sequence[list[int]],
                       step: int) -> list[list[Sample]]:
        """G samples for every prompt from ``clients`` (the live servers), grouped per prompt in order.

        Sends only the requests no earlier call finished. Raises ``EveryServerDown`` when every client failed
        (after every request has either finished or found no server left), or the first other error."""
        if not clients:
            raise ValueError("rollout: at least one server is needed")
        self.clients, self.alive = list(clients), [True] * len(clients)
        self.in_flight, self.assigned = [0] * len(clients), [0] * len(clients)
        n = self.sampling.n_samples
        todo = [(p, j) for p in range(len(prompts)) for j in range(n) if (p, j) not in self.finished]
        results = await asyncio.gather(*(self._one(step, p, j, prompts[p]) for p, j in todo), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise next((e for e in errors if not isinstance(e, EveryServerDown)), errors[0])
        return [[self.finished[(p, j)] for j in range(n)] for p in range(len(prompts))]
