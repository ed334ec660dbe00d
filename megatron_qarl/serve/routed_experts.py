"""Routed experts (R3) as SGLang 0.5.23 captures and returns them, kept per request by the embedded engine.

SGLang (sglang/srt/state_capturer/routed_experts.py, base.py; sglang/srt/managers/scheduler_components/
batch_result_processor.py, ``_maybe_collect_routed_experts``): every forward writes each token's top-k expert ids
into a host buffer row indexed by the token's KV-cache slot; when a request finishes, the rows of its KV slots for
positions [routed_experts_start_len, seqlen - 1) are gathered. So a position's routes are those of the last forward
that computed its KV. A retract frees the KV (``Req.reset_for_retract`` also sets ``routed_experts = None``) and the
re-prefill after ``continue_generation`` recomputes every position: under new weights, every route of the answer
is the new version's, including the positions whose next token the old version sampled. The trainer keeps R3
exact per segment by not retracting when it wants routes (train/pipeline.py).

A request aborted while waiting (never prefilled, or retracted) has no KV slot: SGLang answers it from the
tokenizer manager (``_handle_abort_req``) without ``routed_experts``; ``has_routes`` is False for it here too.
"""

from __future__ import annotations

import torch

from megatron_qarl.serve.request import Request


def capture(reqs: list[Request], routes_BTLK: torch.Tensor, prefill: bool) -> None:
    """Keep the routes of one forward with the requests that asked for them: a prefill (which computes the KV of
    every position from 0) replaces what a request had, a decode step appends its one position."""
    for req, routes_TLK in zip(reqs, routes_BTLK, strict=True):
        if req.return_routed_experts:
            req.routes = [routes_TLK] if prefill else [*req.routes, routes_TLK]


def has_routes(req: Request) -> bool:
    """Whether the request's answer carries ``routed_experts``: it asked, and it holds the routes of a forward."""
    return req.return_routed_experts and bool(req.routes)


def answer_rows(req: Request) -> torch.Tensor:
    """int32 [seqlen - 1 - start, layers, top-k]: positions [start, seqlen - 1) (the last token was never
    forwarded), start = min(routed_experts_start_len, seqlen - 1), as SGLang's ``get_topk`` slices them."""
    routes = torch.cat(req.routes)
    seqlen = req.seqlen
    start = min(req.routed_experts_start_len, seqlen - 1)
    return routes[start: seqlen - 1]
