"""The Megatron learner of one rank: the sharded Qwen3-MoE policy, its DDP wrapper and optimizer.

Every rank of the learner group builds one `Learner` with the same batch; each data-parallel rank
takes its slice of the responses. Log-probs come from Megatron's vocab-parallel cross entropy
(logp = -CE), so the full vocabulary is never gathered on one rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from megatron_qarl.algo.policy_loss import PolicyLossConfig, loss_normalizer, policy_loss
from megatron_qarl.config import OptimConfig, ParallelConfig
from megatron_qarl.moe.model import Qwen3MoeArch, build_model, causal_mask
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.modules import apply_fake_quant


@dataclasses.dataclass
class Batch:
    """Token sequences and which target positions count.

    tokens_BS: prompt + response ids (right-padded), loss_mask_BT (T = S - 1): 1 where token t+1 is
    a response token whose log-prob enters the loss. ``extra`` holds per-response tensors a loss
    function needs (advantages, old / sampler log-probs), sliced with the batch.
    """

    tokens_BS: torch.Tensor
    loss_mask_BT: torch.Tensor
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def rows(self, index: torch.Tensor | slice) -> Batch:
        return Batch(self.tokens_BS[index], self.loss_mask_BT[index], {k: v[index] for k, v in self.extra.items()})

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.tokens_BS.to(device), self.loss_mask_BT.to(device),
                     {k: v.to(device) for k, v in self.extra.items()})

    def micro_batches(self, size: int | None) -> list[Batch]:
        """Consecutive slices of at most ``size`` rows (None: the whole batch)."""
        n = self.tokens_BS.shape[0]
        size = size or n
        return [self.rows(slice(i, min(i + size, n))) for i in range(0, n, size)]


# per-call metrics that add up over micro-batches; every other metric is averaged over them
SUMMED_METRICS = ("loss", "num_responses", "num_tokens")


# loss_fn(logp_BT, batch_slice) -> (loss, metrics): the slice's share of the global loss (normalised by the
# whole batch's count, which the loss function holds; see policy_loss_fn)
LossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, dict]]


class Learner:
    """One rank's shard of the policy with its optimizer (parallel state must be initialised)."""

    def __init__(self, arch: Qwen3MoeArch, parallel: ParallelConfig, optim: OptimConfig,
                 dtype: torch.dtype = torch.float32, quant: QuantConfig | None = None, aligned: bool = True,
                 micro_batch_size: int | None = None):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.arch = arch
        self.parallel = parallel
        self.module = build_model(arch, tp=parallel.tp, ep=parallel.ep, sp=parallel.sp, dtype=dtype,
                                  dispatcher=parallel.dispatcher)
        # rollout-aligned QAT: the forward computes with the rollout engine's low-bit weights; unaligned,
        # the same quantizer only produces what the rollout servers load
        self.fake_quant = (apply_fake_quant(self.module, arch, quant, forward=aligned)
                           if quant and quant.enabled else None)
        self.model = DistributedDataParallel(
            self.module.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                          use_distributed_optimizer=False),
            self.module,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay,
                            adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                            clip_grad=optim.clip_grad, bf16=dtype == torch.bfloat16,
                            params_dtype=dtype),
            [self.model],
        )
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.tp = parallel.tp
        self.clip_grad = optim.clip_grad
        self.micro_batch_size = micro_batch_size  # rows per forward/backward (None: this rank's whole share)
        self.device = next(self.module.parameters()).device

    def load_hf(self, model_dir: str) -> None:
        from megatron_qarl.moe.convert import SafetensorsDir, load_hf_into_model

        load_hf_into_model(self.module, self.arch, SafetensorsDir(model_dir))
        if self.fake_quant:
            self.fake_quant.invalidate()

    def _pad_seq(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Right-pad the sequence to a multiple of TP (sequence parallel splits it)."""
        pad = (-tokens_BS.shape[1]) % self.tp
        return torch.nn.functional.pad(tokens_BS, (0, pad)) if pad else tokens_BS

    def logprobs(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """log pi(tokens[:, t+1] | tokens[:, :t+1]) for t < S-1: [B, S-1], fp32, with autograd."""
        seq = tokens_BS.shape[1]
        padded = self._pad_seq(tokens_BS.to(self.device))
        labels = torch.roll(padded, -1, dims=1)
        s = padded.shape[1]
        position_ids = torch.arange(s, device=self.device).unsqueeze(0).expand_as(padded)
        ce_BS = self.model(padded, position_ids, causal_mask(s).to(self.device), labels=labels)
        return -ce_BS[:, : seq - 1].float()

    @torch.no_grad()
    def forward_logprobs(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """The aligned forward (fake quant on when configured): logp [B, S-1] of the whole batch on
        every rank; each data-parallel rank computes its slice (rows padded to a multiple of the
        data-parallel size by repeating the last one), then they are all-gathered."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        self.model.eval()
        rows = tokens_BS.shape[0]
        pad = (-rows) % self.dp_size
        if pad:
            tokens_BS = torch.cat([tokens_BS, tokens_BS[-1:].expand(pad, -1)])
        rows_BS = tokens_BS[self.my_rows(tokens_BS.shape[0])]
        size = self.micro_batch_size or rows_BS.shape[0]
        mine = torch.cat([self.logprobs(rows_BS[i:i + size]).cpu() for i in range(0, rows_BS.shape[0], size)])
        if self.dp_size == 1:
            return mine
        parts = [torch.empty_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(parts, mine.contiguous(), group=ps.get_data_parallel_group())
        return torch.cat(parts)[:rows]

    def my_rows(self, batch_size: int) -> slice:
        """The responses this data-parallel rank trains on (contiguous, equal split)."""
        if batch_size % self.dp_size:
            raise ValueError(f"batch of {batch_size} responses does not split over data-parallel size "
                             f"{self.dp_size}")
        per = batch_size // self.dp_size
        return slice(self.dp_rank * per, (self.dp_rank + 1) * per)

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict:
        """One optimizer step on the whole batch (this rank takes its data-parallel slice).

        ``loss_fn(logp_BT, batch)`` must return this slice's share of the global loss (normalised by
        the global count). Megatron's DDP averages gradients over data-parallel ranks, so the loss
        is multiplied by the data-parallel size first: the sum over ranks is the global gradient.
        A non-finite loss or gradient norm skips the update (``skipped`` = 1).
        """
        from megatron.core.distributed import finalize_model_grads

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        local = batch.rows(self.my_rows(batch.tokens_BS.shape[0]))
        loss = torch.zeros((), device=self.device)
        parts: list[dict] = []
        for micro in local.micro_batches(self.micro_batch_size):  # gradients accumulate in DDP's buffers
            micro = micro.to(self.device)
            micro_loss, micro_metrics = loss_fn(self.logprobs(micro.tokens_BS), micro)
            (micro_loss * self.dp_size).backward()
            loss = loss + micro_loss.detach()
            parts.append(micro_metrics)
        metrics = {k: (sum(float(p[k]) for p in parts) if k in SUMMED_METRICS else
                       sum(float(p[k]) for p in parts) / len(parts)) for k in parts[0]}
        finalize_model_grads([self.model])
        global_loss = self._dp_sum(loss)
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())  # over every model-parallel rank and expert group
        finite = not found_inf and math.isfinite(grad_norm) and math.isfinite(global_loss)
        if finite:
            self._clip(grad_norm)
            self.optimizer.step_with_ready_grads()
            if self.fake_quant:
                self.fake_quant.invalidate()
        metrics = dict(metrics)
        metrics.update(loss=global_loss, grad_norm=grad_norm, skipped=0.0 if finite else 1.0)
        return metrics

    def _clip(self, grad_norm: float) -> None:
        """Scale every gradient by clip_grad / grad_norm when below 1 (the global norm, dense + experts)."""
        from megatron.core.optimizer import optimizer as mopt

        if self.clip_grad <= 0:
            return
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = opt.get_parameters()
            if params:
                mopt.clip_grad_by_total_norm_fp32(params, max_norm=self.clip_grad, total_norm=grad_norm)

    def _dp_sum(self, value: torch.Tensor) -> float:
        """Sum of the per-rank loss shares = the global loss."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        v = value.clone().float().reshape(1)
        if self.dp_size > 1:
            dist.all_reduce(v, group=ps.get_data_parallel_group())
        return v.item()


def policy_loss_fn(cfg: PolicyLossConfig, batch: Batch) -> LossFn:
    """algo/'s policy loss for `Learner.train_step`. ``batch.extra`` holds adv_B, logp_old_BT and
    logp_sampler_BT (aligned with loss_mask_BT); the normaliser is the whole batch's, so the
    data-parallel shares add up to the global loss."""
    normalizer = loss_normalizer(batch.loss_mask_BT, cfg)

    def loss_fn(logp_BT: torch.Tensor, b: Batch) -> tuple[torch.Tensor, dict]:
        return policy_loss(logp_BT, b.extra["logp_old_BT"], b.extra["logp_sampler_BT"], b.loss_mask_BT,
                           b.extra["adv_B"], cfg, normalizer=normalizer)

    return loss_fn


def token_mean_nll(logp_BT: torch.Tensor, batch: Batch, total_tokens: int) -> tuple[torch.Tensor, dict]:
    """Supervised loss: -sum(mask * logp) / total_tokens (total over the whole batch)."""
    mask = batch.loss_mask_BT.to(logp_BT.dtype)
    return -(logp_BT * mask).sum() / total_tokens, {}
