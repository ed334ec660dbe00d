"""Rollout routing replay (R3): the experts the rollout server routed each token to, as SGLang returns them,
laid out for the learner, and how often the learner's own routing agrees.

SGLang 0.5.23 (``return_routed_experts`` in /generate, server flag ``--enable-return-routed-experts``)
answers ``meta_info.routed_experts`` = base64 of the bytes of an int32 tensor [rows, layers, top-k]
(sglang/srt/managers/detokenizer_manager.py; decoded by ``extract_routed_experts_from_meta_info`` in
sglang/srt/state_capturer/routed_experts.py). Row r is the forward of position ``start + r``: the
positions [start, seqlen - 1), seqlen = prompt + response tokens (the last token is never forwarded).
A sample's first request asks for start = 0, so row t is position t, the forward that scored token t + 1 -- the
same index as the learner's log-prob ``logp_BT[:, t]``; the continuation of an aborted request (rollout/manager.py)
asks for the rows of its new positions only and they are appended.

Shapes: B responses, S tokens (prompt + response, right-padded), T = S - 1, L MoE layers, K = top-k.
"""

from __future__ import annotations

import base64
import binascii

import torch


class RoutesError(ValueError):
    """Routes that cannot be replayed; the message names the sample and what was wrong."""


def decode_routed_experts(encoded: str | None, seqlen: int, layers: int, topk: int, num_experts: int,
                          where: str, start: int = 0) -> torch.Tensor:
    """SGLang's ``routed_experts`` string -> int32 [seqlen - 1 - start, L, K] (positions [start, seqlen - 1), as
    asked with ``routed_experts_start_len``), checked (``where`` names the sample)."""
    if encoded is None:
        raise RoutesError(f"{where}: no meta_info.routed_experts (routing replay needs servers started with "
                          "--enable-return-routed-experts, and return_routed_experts in the request)")
    try:
        raw = base64.b64decode(encoded.encode("utf-8"), validate=True)
    except (binascii.Error, ValueError) as err:
        raise RoutesError(f"{where}: routed_experts is not base64: {err}") from None
    rows = seqlen - 1 - start
    if len(raw) != rows * layers * topk * 4:
        raise RoutesError(f"{where}: routed_experts has {len(raw)} bytes; expected int32 [{rows}, {layers}, {topk}]"
                          f" = {rows * layers * topk * 4} (positions {start}..{seqlen - 2} of a {seqlen}-token "
                          "sequence)")
    routes = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(rows, layers, topk)
    bad = (routes < 0) | (routes >= num_experts)
    if bad.any():
        r, layer, _ = (int(i) for i in bad.nonzero()[0])
        raise RoutesError(f"{where}: routed_experts position {r} layer {layer} has expert ids "
                          f"{routes[r, layer].tolist()} outside [0, {num_experts})")
    if (routes.sort(-1).values.diff(dim=-1) == 0).any():
        raise RoutesError(f"{where}: routed_experts repeats an expert within a token's top-{topk}")
    return routes


def routes_batch(per_sample: list[torch.Tensor], seq: int, layers: int, topk: int) -> torch.Tensor:
    """Right-padded int64 [B, S, L, K]: sample i's routes at positions 0..len_i - 2. The positions no forward
    of the server covered (each sample's last token and the padding) get experts 0..K-1: the learner's
    outputs there feed no log-prob (causal attention, and logp_BT[:, t] reads position t only)."""
    filler = torch.arange(topk, dtype=torch.int64).expand(len(per_sample), seq, layers, topk)
    out = filler.clone()
    for i, routes in enumerate(per_sample):
        out[i, : routes.shape[0]] = routes
    return out


def routing_agreement(learner_BSLK: torch.Tensor, server_BSLK: torch.Tensor, mask_BT: torch.Tensor) -> dict:
    """How often the learner, routing on its own, picks the server's top-k expert SET, over response tokens
    (positions t with mask_BT[:, t] = 1):

        agree_token_layer = mean over (token, layer) of [set(learner) == set(server)]
        agree_token       = mean over tokens of [all layers agree]
    """
    t = mask_BT.shape[1]
    same_BTL = (learner_BSLK[:, :t].sort(-1).values == server_BSLK[:, :t].sort(-1).values).all(-1)
    keep = mask_BT > 0
    n = max(int(keep.sum()), 1)
    return {"agree_token_layer": float(same_BTL[keep].float().mean()) if keep.any() else 1.0,
            "agree_token": float(same_BTL.all(-1)[keep].sum()) / n if keep.any() else 1.0}
