"""The embedded rollout engine: a thread that steps every active sequence together.

Requests enter the queue (serve/scheduler.py); the engine thread admits them into free KV-cache slots (one
prefill each, which also samples the first new token), then runs one batched decode step over all active
sequences, and repeats: continuous batching, so a request that arrives mid-generation joins at the next step.
All model work happens on that thread under ``lock``; weight changes (serve/weight_loading.py) take the same
lock, so they land between two steps.

Its rooms: serve/request.py (a request, its validation), serve/sampling.py (sampling and log-probs, SGLang's
semantics: output log-probs of the temperature-scaled distribution, prompt log-probs of the unscaled one),
serve/routed_experts.py (R3 routes per request), serve/scheduler.py (queue, slots, pause states),
serve/weight_loading.py (weight updates and versions); serve/model.py is the network and its KV cache.
The learner divides its logits by the sampling temperature (``rollout.sampling.temperature``: 1.0 in the CPU
configs, 0.8 in the 30B ones) before its log-softmax, so its log-probs and the sampler's are of the same
distribution at any temperature.
"""

from __future__ import annotations

import threading
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from megatron_qarl.numerics.ops import log_softmax as _exact_log_softmax
from megatron_qarl.serve import routed_experts
from megatron_qarl.serve.model import Qwen3MoeEngineModel
from megatron_qarl.serve.request import Limits, Request, SamplingParams, eos_ids, new_request
from megatron_qarl.serve.sampling import prompt_logprobs, sample, torch_log_softmax
from megatron_qarl.serve.scheduler import Scheduler
from megatron_qarl.serve.weight_loading import WeightLoader, in_fresh_thread
from megatron_qarl.wire import parse_dtype


class EngineConfig(BaseModel):
    """Settings of one embedded engine.

    dtype: compute dtype of attention, router, norms, embeddings, lm_head, activations: ``bfloat16``
        (fast) or ``float32`` (reproduces an fp32 learner / transformers to ~1e-6; used by the tests).
    max_batch_size: KV-cache slots = sequences decoded together.
    max_seq_len: cache length per slot (prompt + completion); None = the model's max_position_embeddings.
    return_original_logprob: output log-probs of the unscaled distribution (SGLang's
        ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; serve/sampling.py).
    kv_cache_dtype: SGLang's --kv-cache-dtype: ``auto`` (the compute dtype) or an FP8 cache (qat/kv_cache.py).
    kv_cache_mib: the KV cache's memory, which bounds the slots (serve/model.py ``kv_slots``); None: max_batch_size.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    max_batch_size: int = Field(default=16, ge=1, le=1024)
    max_seq_len: int | None = Field(default=None, ge=2)
    return_original_logprob: bool = False
    num_threads: int | None = Field(default=None, ge=1)
    enable_return_routed_experts: bool = False  # SGLang's --enable-return-routed-experts (R3)
    numerics: Literal["default", "exact"] = "default"  # exact: numerics/ kernels, the learner's bits (docs/numerics.md)
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = "auto"
    kv_cache_mib: float | None = Field(default=None, gt=0)


class Engine:
    """Model + engine thread. ``submit`` is thread-safe; results arrive through ``Request.on_done``. ``weights``
    changes the weights and names their version; ``scheduler`` holds the queue and slots."""

    def __init__(self, cfg: EngineConfig, model: Qwen3MoeEngineModel | None = None):
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.model = model or in_fresh_thread(Qwen3MoeEngineModel.from_model_dir, cfg.model_path,
                                              parse_dtype(cfg.dtype), cfg.max_batch_size, cfg.max_seq_len,
                                              cfg.numerics, cfg.kv_cache_dtype, cfg.kv_cache_mib)
        self._log_softmax = _exact_log_softmax if self.model.exact is not None else torch_log_softmax
        self.limits = Limits(self.model.arch.vocab_size, self.model.max_seq_len, eos_ids(cfg.model_path))
        self.lock = threading.RLock()  # model work and weight changes
        self.scheduler = Scheduler(self.model.slots)
        self.weights = WeightLoader(self.model, self.lock, self.scheduler.live)
        self._thread = threading.Thread(target=self._loop, name="qarl-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ public API
    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.limits.max_seq_len

    def make_request(self, prompt_ids: list[int], params: SamplingParams, **kw) -> Request:
        """A Request with the stop set and length budget resolved (raises ValueError on bad input)."""
        return new_request(self.limits, prompt_ids, params, **kw)

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
        self.scheduler.add(req)

    def routed_experts(self, req: Request) -> torch.Tensor:
        """The request's routes as its answer carries them (serve/routed_experts.py)."""
        return routed_experts.answer_rows(req)

    def pause(self, mode: str = "abort") -> int:
        """Stop stepping. ``abort``: finish every request with finish_reason abort (partial output, and the routes
        of the running ones, kept); ``in_place``: keep them with their KV cache; ``retract``: drop their KV cache
        and routes, recomputed by the re-prefill on continue. Returns how many requests were pending."""
        n = self.scheduler.pause()
        with self.lock:  # wait for the running step to end
            if mode == "abort":
                self.abort_all("paused (mode abort)")
            elif mode == "retract":
                self.scheduler.retract_all()
        return n

    def resume(self) -> None:
        self.scheduler.resume()

    def abort_all(self, message: str = "aborted") -> None:
        with self.lock:
            reqs = self.scheduler.take_all()
        for req in reqs:
            self._finish(req, {"type": "abort", "message": message})

    def shutdown(self) -> None:
        self.scheduler.stop()
        self._thread.join(timeout=10)
        self.abort_all("server shutting down")

    # ------------------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        while self.scheduler.wait_for_work():
            try:
                with self.lock:
                    if not self.scheduler.paused:
                        self._step()
            except Exception as err:  # a bug must not kill the thread silently: fail the requests
                self.abort_all(f"engine error: {type(err).__name__}: {err}")

    def _step(self) -> None:
        """Prefill the admitted requests, then one decode step of the others; release the finished ones. Admitted
        requests whose sequences have the same length share one prefill (an RL batch sends G samples of each
        prompt at once); those that want prompt log-probs go alone."""
        done: list[Request] = []
        batches: dict[int, list[Request]] = {}
        for req in self.scheduler.admit():
            if req.wants_prompt_logprobs:
                done += self._prefill([req], all_logits=True)
            else:
                batches.setdefault(req.seqlen, []).append(req)
        for reqs in batches.values():
            done += self._prefill(reqs)
        running = [r for r in self.scheduler.running() if r not in done]
        if running:
            done += self._decode(running)
        for req in done:
            self.scheduler.release(req)
            self._finish(req, req.finish_reason)

    def _prefill(self, reqs: list[Request], all_logits: bool = False) -> list[Request]:
        """Fill the slots' caches with prompt (+ output so far, after a retract) of equal length in one forward and
        sample each one's next token; returns the requests that finished. ``all_logits`` (one request): its
        prompt log-probs too."""
        seqs = torch.tensor([r.prompt_ids + r.output_ids for r in reqs])
        pos = torch.arange(seqs.shape[1])[None].expand_as(seqs)
        logits = self._forward(reqs, seqs, pos, prefill=True, all_logits=all_logits)
        if all_logits:
            req, logits_TV = reqs[0], logits[0]
            req.input_logprobs = prompt_logprobs(logits_TV, req.prompt_ids,
                                                 self._log_softmax)[req.logprob_start_len:]
            logits = logits_TV[-1:]
        return [r for r, lg in zip(reqs, logits, strict=True) if self._append(r, lg)]

    def _decode(self, reqs: list[Request]) -> list[Request]:
        tokens = torch.tensor([[r.output_ids[-1]] for r in reqs])
        pos = torch.tensor([[r.seqlen - 1] for r in reqs])
        logits_BV = self._forward(reqs, tokens, pos, prefill=False)
        return [r for r, lg in zip(reqs, logits_BV, strict=True) if self._append(r, lg)]

    def _forward(self, reqs: list[Request], tokens_BT: torch.Tensor, pos_BT: torch.Tensor, prefill: bool,
                 all_logits: bool = False) -> torch.Tensor:
        """The model's forward over the requests' slots; the routes kept with the requests that ask for them."""
        slots_B = torch.tensor([r.slot for r in reqs])
        if not any(r.return_routed_experts for r in reqs):
            return self.model.forward(tokens_BT, slots_B, pos_BT, all_logits)
        logits, routes_BTLK = self.model.forward_routed(tokens_BT, slots_B, pos_BT, all_logits)
        routed_experts.capture(reqs, routes_BTLK, prefill)
        return logits

    def _append(self, req: Request, logits_V: torch.Tensor) -> bool:
        token, logprob = sample(logits_V, req.params, req.generator, self.cfg.return_original_logprob,
                                self._log_softmax)
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        if token in req.stop_ids:
            req.finish_reason = {"type": "stop", "matched": token}
        elif len(req.output_ids) >= req.max_new_tokens:
            req.finish_reason = {"type": "length", "length": req.max_new_tokens}
        return req.finish_reason is not None

    def _finish(self, req: Request, reason: dict) -> None:
        req.finish_reason = reason
        req.weight_version = self.weights.version
        if req.on_done is not None:
            req.on_done(req)
