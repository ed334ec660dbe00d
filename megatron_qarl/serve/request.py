"""One request of the embedded engine: SGLang's sampling parameters, the request as it runs (its prompt, budget,
completion, log-probs, routes, weight-version events), its validation against the model, and the weight-version
spans its answer reports.

Names follow SGLang 0.5.23's ``Req`` (sglang/srt/managers/schedule_batch.py) where they have a counterpart:
``reset_for_retract`` drops what a retract frees there (the KV cache and, with it, the routed experts captured per
KV slot), so a re-prefill recomputes them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """SGLang's ``sampling_params`` subset the engine honours (unknown fields are rejected, not ignored)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    max_new_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = Field(default=None, ge=0, lt=2**63)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)


@dataclass(eq=False)
class Request:
    """One sequence: its prompt, parameters and, as it runs, its completion."""

    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    return_logprob: bool = False
    logprob_start_len: int = -1
    # routed experts (R3): top-k expert ids of every forwarded position, int32 [positions, layers, top-k];
    # the answer covers positions [routed_experts_start_len, seqlen - 1), as SGLang's (serve/routed_experts.py)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routes: list[torch.Tensor] = field(default_factory=list)  # per forward since the last prefill: [T, layers, k]
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: dict | None = None
    weight_version: str = ""
    # SGLang's WeightVersionEvent list: (the version that was replaced, output tokens at that moment), one per
    # weight change while the request was live with output (weight_version_spans turns them into spans)
    version_events: list[tuple[str, int]] = field(default_factory=list)
    num_retractions: int = 0
    slot: int | None = None
    on_done: Callable[[Request], None] | None = None
    created: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        seed = self.params.sampling_seed
        self.generator.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "little"))

    @property
    def seqlen(self) -> int:
        """Prompt + output tokens so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probs are computed by the first prefill only (``logprob_start_len`` >= 0)."""
        return self.return_logprob and self.logprob_start_len >= 0 and not self.output_ids

    def reset_for_retract(self) -> None:
        """A retract (SGLang's ``Req.reset_for_retract``): the KV slot is gone, and the routed experts with it
        (SGLang captures them per KV slot and sets ``routed_experts = None``); the re-prefill recomputes both for
        every position."""
        self.num_retractions += 1
        self.slot = None
        self.routes = []


def weight_version_spans(events: list[tuple[str, int]], current: str, num_output_tokens: int) -> list[dict]:
    """The output's token ranges per weight version, as SGLang 0.5.23 computes them
    (sglang/srt/utils/weight_versions.py, compute_weight_version_spans): each event (old version, n) says
    tokens [.., n) were sampled before the weights changed from the old version; the rest are ``current``'s.
    Spans are half-open ``{"version", "start", "end"}``; equal neighbours merge, empty ones are dropped."""
    spans: list[dict] = []
    for version, end in [*events, (current, num_output_tokens)]:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the vocabulary, the context, the model's EOS ids."""

    vocab_size: int
    max_seq_len: int
    eos_ids: frozenset[int]


def new_request(limits: Limits, prompt_ids: list[int], params: SamplingParams, **kw) -> Request:
    """A Request with the stop set and length budget resolved (raises ValueError naming the field)."""
    vocab, context = limits.vocab_size, limits.max_seq_len
    if not prompt_ids:
        raise ValueError("input_ids: empty prompt")
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"input_ids: token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
    room = context - len(prompt_ids)
    if room < 1:
        raise ValueError(f"input_ids: prompt of {len(prompt_ids)} tokens leaves no room in the context of {context} "
                         "tokens")
    if params.max_new_tokens is None:
        max_new = min(128, room)  # SGLang's default, clipped to the context
    elif params.max_new_tokens > room:
        raise ValueError(f"sampling_params.max_new_tokens: {params.max_new_tokens} exceeds the context: "
                         f"prompt {len(prompt_ids)} + new tokens must be <= {context}")
    else:
        max_new = params.max_new_tokens
    if params.stop:
        raise ValueError("sampling_params.stop: stop strings are not supported here; use stop_token_ids")
    bad = [t for t in params.stop_token_ids or [] if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"sampling_params.stop_token_ids: {bad[:5]} outside the vocabulary")
    stop = set(params.stop_token_ids or [])
    if not params.ignore_eos:
        stop |= limits.eos_ids
    return Request(list(prompt_ids), params, max_new, frozenset(stop), **kw)


def eos_ids(model_path: str) -> frozenset[int]:
    """EOS ids from generation_config.json or config.json (SGLang stops on them unless ignore_eos)."""
    ids: set[int] = set()
    for fname in ("config.json", "generation_config.json"):
        path = Path(model_path) / fname
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)
