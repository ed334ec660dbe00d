"""The embedded rollout engine: a scheduler thread that steps every active sequence together.

Requests enter a queue; the scheduler thread admits them into free KV-cache slots (one prefill each,
which also samples the first new token), then runs one batched decode step over all active sequences,
and repeats: continuous batching, so a request that arrives mid-generation joins at the next step.
All model work happens on that thread under ``lock``; weight updates take the same lock, so they land
between two steps.

Sampling (SGLang's semantics): temperature < 1e-6 is greedy; otherwise the logits are divided by the
temperature, filtered by top_k then top_p, and sampled with the request's own ``torch.Generator``
(seeded by ``sampling_seed`` when given, so a seed reproduces a completion). Log-probabilities of the
sampled tokens follow SGLang's default: log-softmax of the *temperature-scaled* logits, before any
top-k / top-p filtering (SGLang's sampler; ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` there, like
``EngineConfig.return_original_logprob`` here, returns the unscaled log-softmax instead). Greedy
requests get the plain log-softmax. The learner divides its logits by the same temperature
(``rollout.sampling.temperature``: 1.0 in the CPU configs, 0.8 in the 30B ones) before its log-softmax, so
the two are log-probabilities of the same distribution at any temperature.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from megatron_qarl.rollout.model import Qwen3MoeEngineModel
from megatron_qarl.wire import parse_dtype

SAMPLING_EPS = 1e-6
T = TypeVar("T")


def in_fresh_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a short-lived thread (exceptions re-raised here).

    Why: torch's CPU ops run on OpenMP (libgomp), which keeps a team of worker threads for every thread that
    ever ran a parallel op, until that thread exits. Once libgomp manages more threads than there are CPUs
    it stops spinning between parallel regions and puts workers to sleep after ~100 spins, so every GEMM of
    a decode step pays a futex wake-up: measured on 2 cores, a prepacked bf16 GEMV took 100 us instead of
    50 us on the engine thread after the main thread had built the model. So the heavy one-off work
    (building the model, loading a weight update) runs on a thread that exits and frees its team, and the
    engine thread keeps the only team of the process.
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            box["error"] = err

    thread = threading.Thread(target=run, name="qarl-engine-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[return-value]


class EngineConfig(BaseModel):
    """Settings of one embedded engine.

    dtype: compute dtype of attention, router, norms, embeddings, lm_head, activations: ``bfloat16``
        (fast) or ``float32`` (reproduces an fp32 learner / transformers to ~1e-6; used by the tests).
    max_batch_size: KV-cache slots = sequences decoded together.
    max_seq_len: cache length per slot (prompt + completion); None = the model's max_position_embeddings.
    return_original_logprob: see the module docstring.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    max_batch_size: int = Field(default=16, ge=1, le=1024)
    max_seq_len: int | None = Field(default=None, ge=2)
    return_original_logprob: bool = False
    num_threads: int | None = Field(default=None, ge=1)
    enable_return_routed_experts: bool = False  # SGLang's --enable-return-routed-experts (R3)


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
    # the answer covers positions [routed_experts_start_len, seqlen - 1), as SGLang's
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routes: list[torch.Tensor] = field(default_factory=list)  # per forward: [T, layers, top-k], in position order
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: dict | None = None
    weight_version: str = ""
    # SGLang's WeightVersionEvent list: (the version that was replaced, output tokens at that moment), one per
    # weight change while the request was live with output (weight_versions_spans turns them into spans)
    version_events: list[tuple[str, int]] = field(default_factory=list)
    num_retractions: int = 0
    slot: int | None = None
    on_done: Callable[[Request], None] | None = None
    created: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        seed = self.params.sampling_seed
        self.generator.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "little"))


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


def sample(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           original_logprob: bool) -> tuple[int, float]:
    """(token, its log-probability) from fp32 logits of one sequence (see the module docstring)."""
    if params.temperature < SAMPLING_EPS or params.top_k == 1:
        token = int(torch.argmax(logits_V))
        scaled = logits_V if params.temperature < SAMPLING_EPS else logits_V / params.temperature
        return token, float(torch.log_softmax(scaled, dim=-1)[token])
    logp_V = torch.log_softmax(logits_V / params.temperature, dim=-1)
    probs_V = logp_V.exp()
    if 0 < params.top_k < probs_V.numel():
        kth = torch.topk(probs_V, params.top_k).values[-1]
        probs_V = torch.where(probs_V < kth, 0.0, probs_V)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs_V, descending=True)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) > params.top_p * sorted_p.sum()
        probs_V = probs_V.scatter(0, order, torch.where(drop, 0.0, sorted_p))
    token = int(torch.multinomial(probs_V, 1, generator=generator))
    if original_logprob:
        return token, float(torch.log_softmax(logits_V, dim=-1)[token])
    return token, float(logp_V[token])


class Engine:
    """Model + scheduler thread. ``submit`` is thread-safe; results arrive through ``Request.on_done``."""

    def __init__(self, cfg: EngineConfig, model: Qwen3MoeEngineModel | None = None):
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.model = model or in_fresh_thread(Qwen3MoeEngineModel.from_model_dir, cfg.model_path,
                                              parse_dtype(cfg.dtype), cfg.max_batch_size, cfg.max_seq_len)
        self.weight_version = "default"
        self.eos_ids = _eos_ids(cfg.model_path)
        self.lock = threading.RLock()  # model work and weight updates
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: dict[int, Request] = {}  # slot -> request
        self._free_slots = list(range(self.model.slots))
        self._paused = False
        self._stopped = False
        self.steps = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="qarl-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ public API
    @property
    def vocab_size(self) -> int:
        return self.model.arch.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    def make_request(self, prompt_ids: list[int], params: SamplingParams, **kw) -> Request:
        """A Request with the stop set and length budget resolved (raises ValueError on bad input)."""
        if not prompt_ids:
            raise ValueError("input_ids: empty prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids: token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        room = self.max_seq_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"input_ids: prompt of {len(prompt_ids)} tokens leaves no room in the context "
                             f"of {self.max_seq_len} tokens")
        if params.max_new_tokens is None:
            max_new = min(128, room)  # SGLang's default, clipped to the context
        elif params.max_new_tokens > room:
            raise ValueError(f"sampling_params.max_new_tokens: {params.max_new_tokens} exceeds the context: "
                             f"prompt {len(prompt_ids)} + new tokens must be <= {self.max_seq_len}")
        else:
            max_new = params.max_new_tokens
        if params.stop:
            raise ValueError("sampling_params.stop: stop strings are not supported here; use stop_token_ids")
        bad = [t for t in params.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"sampling_params.stop_token_ids: {bad[:5]} outside the vocabulary")
        stop = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop |= self.eos_ids
        return Request(list(prompt_ids), params, max_new, frozenset(stop), **kw)

    def submit(self, req: Request) -> None:
        if req.return_routed_experts:  # SGLang's scheduler aborts these (scheduler.py, handle_generate_request)
            start, n = req.routed_experts_start_len, len(req.prompt_ids)
            if start < 0:
                return self._finish(req, {"type": "abort", "message": f"recv_req.routed_experts_start_len={start} "
                                          "is lower than 0. Please use a non-negative routed_experts_start_len."})
            if start > n:
                return self._finish(req, {"type": "abort", "message": f"recv_req.routed_experts_start_len={start} "
                                          f"is higher than the number of input tokens len(req.origin_input_ids)={n}."
                                          " Please use a smaller routed_experts_start_len."})
            req.return_routed_experts = self.cfg.enable_return_routed_experts  # no capturer: no routes, silently
        if req.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        with self._cv:
            self._waiting.append(req)
            self._cv.notify()

    def num_pending(self) -> int:
        with self._cv:
            return len(self._waiting) + len(self._active)

    def num_unflushable(self) -> int:
        """The requests that keep /flush_cache from flushing: SGLang's ``is_fully_idle(ignore_waiting=paused)``
        (sglang/srt/managers/scheduler.py): the running ones, plus the waiting ones unless generation is paused
        (a retracted request waits without a cache and is re-prefilled on continue)."""
        with self._cv:
            return len(self._active) + (0 if self._paused else len(self._waiting))

    def pause(self, mode: str = "abort") -> int:
        """Stop stepping. ``abort``: finish every request with finish_reason abort; ``in_place``: keep them
        with their KV cache; ``retract``: drop their KV cache, re-prefilled on continue. Returns how many
        requests were pending."""
        with self._cv:
            n = len(self._waiting) + len(self._active)
            self._paused = True
        with self.lock:  # wait for the running step to end
            if mode == "abort":
                self.abort_all("paused (mode abort)")
            elif mode == "retract":
                with self._cv:
                    for slot, req in sorted(self._active.items(), reverse=True):
                        req.slot = None
                        req.num_retractions += 1
                        self._waiting.appendleft(req)
                        self._free_slots.append(slot)
                    self._active.clear()
        return n

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    def abort_all(self, message: str = "aborted") -> None:
        with self.lock, self._cv:
            reqs = list(self._waiting) + list(self._active.values())
            self._waiting.clear()
            self._free_slots.extend(self._active)
            self._active.clear()
        for req in reqs:
            self._finish(req, {"type": "abort", "message": message})

    def update_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str | None) -> None:
        """Load and finalize at once (an update from disk)."""
        self._update(lambda: in_fresh_thread(self.model.update_tensors, tensors), weight_version)

    def load_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str | None) -> None:
        """Load one bucket of a weight-update session; the low-bit layers are rebuilt at ``finalize_weights``."""
        self._update(lambda: self.model.load_tensors(tensors), weight_version)

    def apply_deltas(self, parts: dict[str, tuple[torch.Tensor, torch.Tensor]], weight_version: str | None) -> None:
        """Apply one bucket of a delta sync in place (``Qwen3MoeEngineModel.apply_deltas``); finalized at
        ``finalize_weights`` like a loaded bucket."""
        self._update(lambda: self.model.apply_deltas(parts), weight_version)

    def set_weight_version(self, weight_version: str) -> None:
        """Name the held weights ``weight_version`` without changing them (SGLang's /update_weight_version)."""
        self._update(lambda: None, weight_version)

    def _update(self, change: Callable[[], None], weight_version: str | None) -> None:
        """A weight change between two engine steps; the version moves only once it succeeded. As SGLang's
        ``record_weight_version_change`` (scheduler.py), every live request with output records the version
        its tokens so far were sampled with (``Request.version_events``)."""
        with self.lock:
            change()
            if weight_version is not None and weight_version != self.weight_version:
                with self._cv:
                    live = list(self._waiting) + list(self._active.values())
                for req in live:
                    if req.output_ids:
                        req.version_events.append((self.weight_version, len(req.output_ids)))
                self.weight_version = weight_version

    def finalize_weights(self) -> int:
        """End of a weight-update session: repack / prepack what was loaded (returns the linears rebuilt)."""
        with self.lock:
            return in_fresh_thread(self.model.finalize_weights)

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)
        self.abort_all("server shutting down")

    # ------------------------------------------------------------------------------ scheduler
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._paused or not (self._waiting or self._active)):
                    self._cv.wait()
                if self._stopped:
                    return
            try:
                with self.lock:
                    if not self._paused:
                        self._step()
            except Exception as err:  # a bug must not kill the thread silently: fail the requests
                self.abort_all(f"engine error: {type(err).__name__}: {err}")

    def _step(self) -> None:
        done: list[Request] = []
        admitted: list[Request] = []
        while True:
            with self._cv:
                if not (self._waiting and self._free_slots):
                    break
                req = self._waiting.popleft()
                req.slot = self._free_slots.pop(0)
                self._active[req.slot] = req
            admitted.append(req)
        # prefill: requests whose sequences have the same length share one forward (an RL batch sends G
        # samples of each prompt at once); those that want prompt log-probs go alone
        batches: dict[int, list[Request]] = {}
        for req in admitted:
            if req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids:
                done += [req] if self._prefill(req) else []
            else:
                batches.setdefault(len(req.prompt_ids) + len(req.output_ids), []).append(req)
        for reqs in batches.values():
            done += self._prefill_batch(reqs)
        with self._cv:
            running = [r for r in self._active.values() if r not in done]
        if running:
            done += self._decode(running)
        for req in done:
            self._release(req)
        next(self.steps)

    def _prefill(self, req: Request) -> bool:
        """Fill the slot's cache with prompt (+ output so far, after a retract); sample the next token."""
        seq = req.prompt_ids + req.output_ids
        want_inputs = req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids
        logits, routes = self._forward([req], torch.tensor([seq]), torch.tensor([req.slot]),
                                       torch.arange(len(seq))[None], all_logits=want_inputs)
        if want_inputs:
            logits_TV = logits[0]
            self._input_logprobs(req, logits_TV)
            logits = logits_TV[-1:]
        return self._append(req, logits[0])

    def _prefill_batch(self, reqs: list[Request]) -> list[Request]:
        """Prefill requests of equal sequence length in one forward; sample each one's next token."""
        seqs = torch.tensor([r.prompt_ids + r.output_ids for r in reqs])
        pos = torch.arange(seqs.shape[1])[None].expand_as(seqs)
        logits_BV, _ = self._forward(reqs, seqs, torch.tensor([r.slot for r in reqs]), pos)
        return [r for r, lg in zip(reqs, logits_BV, strict=True) if self._append(r, lg)]

    def _input_logprobs(self, req: Request, logits_TV: torch.Tensor) -> None:
        t = req.params.temperature
        scaled = logits_TV if (t < SAMPLING_EPS or self.cfg.return_original_logprob) else logits_TV / t
        logp = torch.log_softmax(scaled[:-1], dim=-1).gather(-1, torch.tensor(req.prompt_ids[1:])[:, None])[:, 0]
        full = [None, *logp.tolist()]
        req.input_logprobs = full[req.logprob_start_len:]

    def _decode(self, reqs: list[Request]) -> list[Request]:
        tokens = torch.tensor([[r.output_ids[-1]] for r in reqs])
        pos = torch.tensor([[len(r.prompt_ids) + len(r.output_ids) - 1] for r in reqs])
        logits_BV, _ = self._forward(reqs, tokens, torch.tensor([r.slot for r in reqs]), pos)
        return [r for r, lg in zip(reqs, logits_BV, strict=True) if self._append(r, lg)]

    def _forward(self, reqs: list[Request], tokens_BT: torch.Tensor, slots_B: torch.Tensor, pos_BT: torch.Tensor,
                 all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward; when a request asks for its routed experts, they are kept with it (a
        prefill after a retract recomputes the whole sequence's, so they replace what it had)."""
        if not any(r.return_routed_experts for r in reqs):
            return self.model.forward(tokens_BT, slots_B, pos_BT, all_logits), None
        logits, routes_BTLK = self.model.forward_routed(tokens_BT, slots_B, pos_BT, all_logits)
        for r, routes_TLK in zip(reqs, routes_BTLK, strict=True):
            if r.return_routed_experts:
                if tokens_BT.shape[1] == 1:
                    r.routes = [*r.routes, routes_TLK]
                else:  # a prefill; after a retract the positions already forwarded keep the routes of the
                    # forward that sampled their next token (the version that sampled it, R3), the rest are new
                    kept = torch.cat(r.routes)[: routes_TLK.shape[0]] if r.routes else routes_TLK[:0]
                    r.routes = [kept, routes_TLK[kept.shape[0]:]]
        return logits, routes_BTLK

    def routed_experts(self, req: Request) -> torch.Tensor:
        """int32 [seqlen - 1 - start, layers, top-k]: positions [start, seqlen - 1) (the last token was never
        forwarded), start = min(routed_experts_start_len, seqlen - 1), as SGLang's capturer slices them."""
        routes = torch.cat(req.routes) if req.routes else torch.empty(0, len(self.model.layers),
                                                                      self.model.arch.num_experts_per_tok,
                                                                      dtype=torch.int32)
        seqlen = len(req.prompt_ids) + len(req.output_ids)
        start = min(req.routed_experts_start_len, seqlen - 1)
        return routes[start: seqlen - 1]

    def _append(self, req: Request, logits_V: torch.Tensor) -> bool:
        token, logprob = sample(logits_V, req.params, req.generator, self.cfg.return_original_logprob)
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        if token in req.stop_ids:
            req.finish_reason = {"type": "stop", "matched": token}
        elif len(req.output_ids) >= req.max_new_tokens:
            req.finish_reason = {"type": "length", "length": req.max_new_tokens}
        return req.finish_reason is not None

    def _release(self, req: Request) -> None:
        with self._cv:
            self._active.pop(req.slot, None)
            self._free_slots.append(req.slot)
            req.slot = None
        self._finish(req, req.finish_reason)

    def _finish(self, req: Request, reason: dict) -> None:
        req.finish_reason = reason
        req.weight_version = self.weight_version
        if req.on_done is not None:
            req.on_done(req)


def _eos_ids(model_path: str) -> set[int]:
    """EOS ids from generation_config.json or config.json (SGLang stops on them unless ignore_eos)."""
    import json
    from pathlib import Path

    ids: set[int] = set()
    for fname in ("config.json", "generation_config.json"):
        path = Path(model_path) / fname
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids
