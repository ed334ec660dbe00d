"""Packed sequences: the learner's rows laid end to end instead of right-padded (issue 55).

The trainer's batch pads every row to the longest (``train.trainer.build_batch``), and a row's log-probs are read
only up to its last loss target. Measured on configs/cpu_default.yaml (``length/padded_frac``, the share of the
computed positions that are padding): 23% of every forward and backward (docs/training.md, "Packed sequences").
Packing computes only the tokens a row needs: with n_b = the row's length up to and including its last loss target
(``loss_lengths``), the micro-batch's rows become one sequence of T = sum n_b tokens (rounded up to a multiple of
``multiple``, the tensor-parallel size that sequence parallelism splits it by, with one padding segment), each token
with its position in its row, and the core attention attends within each row only, causally: a block-diagonal causal
mask, Megatron's THD format (``PackedSeqParams(qkv_format="thd", cu_seqlens)``; ``moe.attention.SDPAttention``
computes it, torch's variable-length flash attention on CUDA). Rotary positions restart at every row (Megatron's
THD rope), the MoE layers are per token, so every log-prob a row reads is the unpadded row's:

    packed:   tokens[0, :n_0] | tokens[1, :n_1] | ... | pad          cu_seqlens = [0, n_0, n_0 + n_1, ..., T]
    logp[b, t] = logp_packed[start_b + t]  for t < n_b - 1,  0 elsewhere (positions no loss reads)

The flat index of each packed token in the [B, S] batch (``Packed.index``) gathers the tokens and scatters the
log-probs back. Built on the host from the lengths, so it reads nothing back from a device.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Packed:
    """One micro-batch packed (module docstring): tokens, positions and labels [1, T]; ``index`` [sum n_b] the flat
    [B, S] position of each real token; ``scored`` [sum n_b] whether its label is its row's next token (all but a
    row's last); ``cu_seqlens`` int32 [rows + 1 (+ 1 with padding)]; ``max_len``."""

    tokens: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    index: torch.Tensor
    scored: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int

    def to(self, device) -> Packed:
        """Every tensor on ``device`` but ``cu_seqlens``, which stays on the host (pinned for a CUDA device): Megatron's
        THD rope reads it (``.tolist()``) in every layer, which on a device would be a sync each time; the CUDA
        attention copies it over itself, asynchronously (``moe.attention.SDPAttention._packed``)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor) and f.name != "cu_seqlens"}
        cu = self.cu_seqlens.pin_memory() if torch.device(device).type == "cuda" else self.cu_seqlens
        return dataclasses.replace(self, cu_seqlens=cu, **moved)


def loss_lengths(loss_mask_BT: torch.Tensor) -> list[int]:
    """Each row's tokens up to and including its last loss target: n_b = max{t : mask[b, t] > 0} + 2 (logp[t]
    scores token t + 1), 0 for a row no loss reads. Host values (the mask is read where it is: the trainer's batch
    is on the host)."""
    mask = loss_mask_BT.detach().to("cpu") > 0
    t = torch.arange(mask.shape[1])
    last = torch.where(mask, t, -2).amax(dim=1) if mask.shape[1] else torch.full((mask.shape[0],), -2)
    return (last + 2).tolist()


def pack(tokens_BS: torch.Tensor, lengths: list[int], multiple: int = 1, pad_id: int = 0) -> Packed:
    """The rows ``tokens_BS[b, :lengths[b]]`` end to end (host tensors; module docstring). A row of length 0 is left
    out; T is padded to a multiple of ``multiple`` with ``pad_id`` tokens forming their own segment."""
    rows, seq = tokens_BS.shape
    if len(lengths) != rows or any(not 0 <= n <= seq for n in lengths):
        raise ValueError(f"lengths: {lengths} do not fit {rows} rows of {seq} tokens")
    kept = [(b, n) for b, n in enumerate(lengths) if n]
    index = torch.cat([b * seq + torch.arange(n) for b, n in kept]) if kept else torch.zeros(0, dtype=torch.long)
    positions = torch.cat([torch.arange(n) for _, n in kept]) if kept else torch.zeros(0, dtype=torch.long)
    flat = tokens_BS.reshape(-1).to("cpu")
    tokens = flat[index]
    # the next token of its row; after a row's last token any label (that log-prob is never read)
    labels = torch.roll(tokens, -1)
    total = index.numel()
    pad = (-total) % multiple if total else max(multiple, 1)  # no row to score: one segment of padding to run on
    bounds = [0]
    for _, n in kept:
        bounds.append(bounds[-1] + n)
    if pad:
        bounds.append(total + pad)
        tokens = torch.cat([tokens, torch.full((pad,), pad_id, dtype=tokens.dtype)])
        labels = torch.cat([labels, torch.full((pad,), pad_id, dtype=labels.dtype)])
        positions = torch.cat([positions, torch.arange(pad)])
    scored = torch.ones(total, dtype=torch.bool)
    scored[torch.tensor(bounds[1: len(kept) + 1], dtype=torch.long) - 1] = False
    return Packed(tokens=tokens[None], positions=positions[None], labels=labels[None], index=index, scored=scored,
                  cu_seqlens=torch.tensor(bounds, dtype=torch.int32), max_len=max([n for _, n in kept] + [pad, 1]))


def unpack(values_1T: torch.Tensor, packed: Packed, shape: tuple[int, int]) -> torch.Tensor:
    """[B, S] with each scored token's value (``Packed.scored``: a log-prob of its row's next token) at its place and
    0 elsewhere; differentiable in ``values_1T``."""
    flat = values_1T.reshape(-1)[: packed.index.numel()]
    out = flat.new_zeros(shape[0] * shape[1])
    return out.index_put((packed.index[packed.scored],), flat[packed.scored]).reshape(shape)


def packed_logprobs(model, tokens_BS: torch.Tensor, lengths: list[int], *, tp: int, device: torch.device,
                    temperature: float) -> torch.Tensor:
    """``Learner.logprobs`` of the rows packed end to end: one THD sequence through ``model`` (Megatron's GPTModel or
    its DDP wrapper, the core attention within each row: ``PackedSeqParams``), log softmax(z / temperature) of each
    row's next token, put back in [B, S-1] (0 where no loss reads; module docstring). ``tp``: the sequence's
    multiple (sequence parallelism)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.packed_seq_params import PackedSeqParams

    packed = pack(tokens_BS, lengths, tp).to(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
                             max_seqlen_q=packed.max_len, max_seqlen_kv=packed.max_len,
                             cp_group=ps.get_context_parallel_group())
    logits_1TV = model(packed.tokens, packed.positions, None, packed_seq_params=params)
    if temperature != 1.0:
        logits_1TV = logits_1TV / temperature
    ce_1T = tensor_parallel.vocab_parallel_cross_entropy(logits_1TV, packed.labels)
    return unpack(-ce_1T.float(), packed, tuple(tokens_BS.shape))[:, : tokens_BS.shape[1] - 1]
