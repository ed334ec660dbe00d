"""The Megatron learner of one rank: the sharded Qwen3-MoE policy, its DDP wrapper and optimizer.

Every rank of the learner group builds one `Learner` with the same batch; each data-parallel rank
takes its slice of the responses. Log-probs come from Megatron's vocab-parallel cross entropy
(logp = -CE), so the full vocabulary is never gathered on one rank.

Temperature: SGLang returns the log-softmax of the temperature-scaled logits (its default; slime and
verl divide the learner's logits the same way), so the learner's aligned and training forwards use

    logp_t = log_softmax(z_t / T)[y_t]    (T = the rollout's sampling temperature)

and every ratio and mismatch compares like with like.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch

from megatron_qarl.algo.policy_loss import PolicyLossConfig, loss_normalizer, policy_loss
from megatron_qarl.config import OptimConfig, ParallelConfig
from megatron_qarl.learner.packing import loss_lengths, packed_logprobs
from megatron_qarl.moe.attention import resolve_attention
from megatron_qarl.moe.exact import exact_forward
from megatron_qarl.moe.model import Qwen3MoeArch, attention_mask, build_model, expert_tp
from megatron_qarl.moe.parallelize import all_gather_tensors, all_reduce, to_group_device
from megatron_qarl.moe.te import check_te_fp8, resolve_impl
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.kv_cache import KVCacheSpec, KVFakeQuant, kv_unaware
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


def offload_kwargs(cpu_offload: bool, fraction: float = 1.0) -> dict:
    """Megatron OptimizerConfig fields of optimizer CPU offload, as slime sets them to train Qwen3-30B-A3B on 8
    H100s (THUDM/slime scripts/run-qwen3-30B-A3B.sh: --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d
    --use-precision-aware-optimizer): Megatron's HybridDeviceOptimizer keeps ``fraction`` of this rank's
    (distributed-optimizer) shard of fp32 master weights and Adam moments on the CPU and steps them with torch's
    CPU AdamW, overlapping the gradient copies to the host and the parameter copies back. The precision-aware
    flag makes the distributed optimizer leave the fp32 master copies to HybridDeviceOptimizer, so the
    offloaded part keeps none on the GPU. Needs the distributed optimizer and CUDA."""
    if not cpu_offload:
        return {}
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction,
            "overlap_cpu_optimizer_d2h_h2d": True, "use_precision_aware_optimizer": True}


class Learner:
    """One rank's shard of the policy with its optimizer (parallel state must be initialised).

    Memory (config.LearnerConfig, counted by ``qarl plan``): ``distributed_optimizer`` shards the fp32 master
    weights and Adam moments over data parallelism (Megatron's DistributedOptimizer: gradients reduce-scattered,
    parameters all-gathered after the step); ``optimizer_cpu_offload`` keeps ``optimizer_offload_fraction`` of the
    shard on the host (``offload_kwargs``; CUDA only); ``recompute`` / ``recompute_num_layers``: Megatron's
    activation recompute (``moe.model.recompute_kwargs``)."""

    def __init__(self, arch: Qwen3MoeArch, parallel: ParallelConfig, optim: OptimConfig,
                 dtype: torch.dtype = torch.float32, quant: QuantConfig | None = None, aligned: bool = True,
                 micro_batch_size: int | None = None, temperature: float = 1.0, routing_replay: bool = False,
                 impl: str = "local", compile_quantizer: bool = False, distributed_optimizer: bool = True,
                 optimizer_cpu_offload: bool = False, optimizer_offload_fraction: float = 1.0, recompute: str = "none",
                 recompute_num_layers: int = 1, te_fp8: bool = False, numerics: str = "default",
                 act_dtype: torch.dtype = torch.bfloat16, refresh_kernel: str = "auto", attention: str = "auto",
                 experts: str = "auto", kv_cache: KVCacheSpec | None = None):
        """``impl``: ``model.impl`` (auto | local | te): the Megatron layer spec the policy is built with; "te" runs
        Transformer Engine layers, in BF16 GEMMs on ModelOpt's fake-quant operands for the quantized schemes
        (``qat/modules.py``). ``te_fp8``: ``model.te_fp8``, TE's blockwise FP8 GEMMs (impl te, schemes bf16 and w4a16,
        ``moe.te.check_te_fp8``).
        ``compile_quantizer``, ``refresh_kernel``: learner.*; the memory options: the class docstring. ``numerics``
        "exact": log-probs from moe/exact.py (the engine's numerics/ kernels, rounding to ``act_dtype``, the servers'
        activation dtype). ``attention``, ``experts``: model.* (``resolve_spec``: ``self.attention``, ``self.experts``
        what was built: sdpa / unfused / te, grouped / sequential / te).
        ``kv_cache``: the servers' FP8 KV cache (rollout.kv_cache_dtype); the aligned learner's attention computes
        on the keys and values it reads back (qat/kv_cache.py ``KVFakeQuant``), an unaligned one on its own."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        check_options(temperature, routing_replay, recompute, optimizer_cpu_offload)
        self.arch, self.parallel, self.temperature = arch, parallel, float(temperature)
        self.impl, self.attention, self.experts = resolve_spec(impl, attention, experts, te_fp8,
                                                              (quant or QuantConfig()).scheme, arch, parallel, dtype)
        self.module = build_model(arch, tp=parallel.tp, ep=parallel.ep, sp=parallel.sp, dtype=dtype,
                                  dispatcher=parallel.dispatcher, routing_replay=routing_replay,
                                  te=self.impl == "te", te_fp8=te_fp8, recompute=recompute,
                                  recompute_num_layers=recompute_num_layers,
                                  attention="unfused" if self.attention == "te" else self.attention,
                                  experts="sequential" if self.experts == "te" else self.experts)
        self.routing_replay = routing_replay  # R3: routes given to logprobs() are replayed by Megatron's routers
        # rollout-aligned QAT: the forward computes with the rollout engine's low-bit weights; unaligned,
        # the same quantizer only produces what the rollout servers load
        self.fake_quant = (apply_fake_quant(self.module, arch, quant, forward=aligned, compiled=compile_quantizer,
                                            refresh_kernel=refresh_kernel)
                           if quant and quant.enabled else None)
        self.kv_cache = kv_cache if aligned else None
        self.kv_fake_quant = KVFakeQuant(self.module, self.kv_cache) if self.kv_cache is not None else None
        self.exact = exact_forward(numerics, self, act_dtype, quant, aligned)  # None unless numerics: exact
        # packed sequences (learner/packing.py) where the core attention takes them and R3 does not replay [B, S] routes
        self.packs = self.attention == "sdpa" and self.exact is None and not routing_replay
        self.model = DistributedDataParallel(
            self.module.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                          use_distributed_optimizer=distributed_optimizer),
            self.module,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay,
                            adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                            clip_grad=optim.clip_grad, bf16=dtype == torch.bfloat16,
                            params_dtype=dtype, use_distributed_optimizer=distributed_optimizer,
                            **offload_kwargs(optimizer_cpu_offload, optimizer_offload_fraction)),
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
        weights_changed(self)

    def _pad_seq(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Right-pad the sequence to a multiple of TP (sequence parallel splits it)."""
        pad = (-tokens_BS.shape[1]) % self.tp
        return torch.nn.functional.pad(tokens_BS, (0, pad)) if pad else tokens_BS

    def logprobs(self, tokens_BS: torch.Tensor, routes_BSLK: torch.Tensor | None = None,
                 lengths: list[int] | None = None) -> torch.Tensor:
        """log softmax(z / T)[tokens[:, t+1]] given tokens[:, :t+1], for t < S-1: [B, S-1], fp32, with
        autograd (T = ``temperature``; the vocabulary stays split over tensor-parallel ranks).

        ``routes_BSLK`` (R3; needs ``routing_replay``): every MoE layer routes position s of row b to the
        experts ``routes_BSLK[b, s, layer]`` (the rollout server's) instead of its own top-k; the gate
        weights are the softmax of the router's logits over those experts.
        ``lengths`` (host ints, ``packing.loss_lengths``): row b needs only its first lengths[b] tokens; where the
        learner packs (``self.packs``) they are computed end to end without padding (``learner/packing.py``) and
        logp[b, t] for t >= lengths[b] - 1 is 0."""
        return self._logprobs(tokens_BS, routes_BSLK, record=False, lengths=lengths)[0]

    def _logprobs(self, tokens_BS: torch.Tensor, routes_BSLK: torch.Tensor | None, record: bool,
                  temperature: float | None = None,
                  lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logp [B, S-1] at ``temperature`` or the learner's, and with ``record`` the experts this rank's routers
        chose: [B, S_local, L, K]); ``lengths``: see ``logprobs``."""
        from megatron.core import tensor_parallel

        if lengths is not None and self.packs:
            temperature = self.temperature if temperature is None else temperature
            return packed_logprobs(self.model, tokens_BS, lengths, tp=self.tp, device=self.device,
                                   temperature=temperature), None
        seq = tokens_BS.shape[1]
        padded = self._pad_seq(tokens_BS.to(self.device))
        labels_BS = torch.roll(padded, -1, dims=1)
        s = padded.shape[1]
        position_ids = torch.arange(s, device=self.device).unsqueeze(0).expand_as(padded)
        if routes_BSLK is not None:
            if not self.routing_replay:
                raise ValueError("routes_BSLK: this learner was built without routing_replay")
            if tuple(routes_BSLK.shape[:2]) != tuple(tokens_BS.shape):
                raise ValueError(f"routes_BSLK: shape {list(routes_BSLK.shape)} does not match tokens "
                                 f"{list(tokens_BS.shape)}")
            k = routes_BSLK.shape[-1]  # TP padding positions: experts 0..K-1 (their outputs are never read)
            fill = torch.arange(k, device=routes_BSLK.device).expand(routes_BSLK.shape[0], s - seq,
                                                                     routes_BSLK.shape[2], k)
            routes_BSLK = torch.cat([routes_BSLK.to(torch.int64), fill], dim=1)
        temperature = self.temperature if temperature is None else temperature
        if self.exact is not None:  # numerics: exact (no routing replay: refused at construction)
            return self.exact.logprobs(padded, labels_BS, temperature)[:, : seq - 1], None
        replay = _Replay(self, padded.shape, routes_BSLK, record) if self.routing_replay else None
        try:
            logits_BSV = self.model(padded, position_ids, attention_mask(self.attention, s, self.device))  # vocab shard
            routes = replay.recorded() if replay is not None and record else None
        finally:
            if replay is not None:
                replay.close()
        if temperature != 1.0:
            logits_BSV = logits_BSV / temperature
        ce_BS = tensor_parallel.vocab_parallel_cross_entropy(logits_BSV, labels_BS)
        return -ce_BS[:, : seq - 1].float(), routes

    @torch.no_grad()
    def forward_logprobs(self, tokens_BS: torch.Tensor, routes_BSLK: torch.Tensor | None = None,
                         temperature: float | None = None, lengths: list[int] | None = None,
                         kv_cache: bool = True) -> torch.Tensor:
        """The aligned forward (fake quant on when configured): logp [B, S-1] of the whole batch on
        every rank; each data-parallel rank computes its slice (rows padded to a multiple of the
        data-parallel size by repeating the last one), then they are all-gathered. ``routes_BSLK``: R3.
        ``temperature``: instead of the learner's (1.0: the unscaled ones, train/pipeline.py's mismatch split).
        ``lengths``: the rows' needed lengths (``logprobs``; packed where the learner packs). ``kv_cache`` False: the
        attention on its own keys and values, not the servers' FP8 cache's (the KV part of the mismatch split)."""
        with contextlib.nullcontext() if kv_cache else kv_unaware(self.kv_fake_quant, self.exact):
            return self._dp_forward(tokens_BS, routes_BSLK, record=False, temperature=temperature, lengths=lengths)[0]

    @torch.no_grad()
    def forward_routes(self, tokens_BS: torch.Tensor,
                       routes_BSLK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The aligned forward and the experts every layer's router used for every position: (logp [B, S-1],
        int64 [B, S, L, K]) on every rank; its own choice, or with ``routes_BSLK`` the replayed ones as
        the routers received them (read back from each RouterReplay)."""
        if not self.routing_replay:
            raise ValueError("forward_routes: this learner was built without routing_replay")
        return self._dp_forward(tokens_BS, routes_BSLK, record=True)

    def _dp_forward(self, tokens_BS: torch.Tensor, routes_BSLK: torch.Tensor | None, record: bool,
                    temperature: float | None = None, lengths: list[int] | None = None):
        from megatron.core import parallel_state as ps

        self.model.eval()
        rows = tokens_BS.shape[0]
        pad = (-rows) % self.dp_size
        if lengths is not None:
            lengths = list(lengths) + lengths[-1:] * pad
        if pad:
            tokens_BS = torch.cat([tokens_BS, tokens_BS[-1:].expand(pad, -1)])
            if routes_BSLK is not None:
                routes_BSLK = torch.cat([routes_BSLK, routes_BSLK[-1:].expand(pad, *routes_BSLK.shape[1:])])
        mine = self.my_rows(tokens_BS.shape[0])
        rows_BS = tokens_BS[mine]
        routes_mine = routes_BSLK[mine] if routes_BSLK is not None else None
        size = self.micro_batch_size or rows_BS.shape[0]
        lengths_mine = lengths[mine] if lengths is not None else None
        parts = [self._logprobs(rows_BS[i:i + size], None if routes_mine is None else routes_mine[i:i + size],
                                record, temperature, None if lengths_mine is None else lengths_mine[i:i + size])
                 for i in range(0, rows_BS.shape[0], size)]
        local = {"log-probs": torch.cat([p[0] for p in parts])}
        if record:
            local["routes"] = self._gather_seq(torch.cat([p[1] for p in parts]))[:, : tokens_BS.shape[1]]
        dp_group = ps.get_data_parallel_group()
        out = {}
        for name, t in local.items():
            peers = all_gather_tensors(to_group_device(t, dp_group), dp_group, self.dp_size, name=name)
            out[name] = torch.cat(peers)[:rows].cpu()
        return out["log-probs"], out.get("routes")

    def _gather_seq(self, local_BSLK: torch.Tensor) -> torch.Tensor:
        """Sequence-parallel routers see this TP rank's chunk of positions: all-gather them along S."""
        from megatron.core import parallel_state as ps

        if not (self.parallel.sp and self.tp > 1):
            return local_BSLK
        group = ps.get_tensor_model_parallel_group()
        return torch.cat(all_gather_tensors(to_group_device(local_BSLK, group), group, self.tp, name="routes"), dim=1)

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
            lengths = loss_lengths(micro.loss_mask_BT) if self.packs else None  # read on the host, before the move
            micro = micro.to(self.device)
            micro_loss, micro_metrics = loss_fn(self.logprobs(micro.tokens_BS, micro.extra.get("routes_BSLK"),
                                                              lengths), micro)
            (micro_loss * self.dp_size).backward()
            loss = loss + micro_loss.detach()
            parts.append(micro_metrics)
        metrics = {k: (sum(float(p[k]) for p in parts) if k in SUMMED_METRICS else
                       sum(float(p[k]) for p in parts) / len(parts)) for k in parts[0]}
        finalize_model_grads([self.model])
        global_loss = dp_sum(loss, self.dp_size)
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())  # over every model-parallel rank and expert group
        finite = not found_inf and math.isfinite(grad_norm) and math.isfinite(global_loss)
        if finite:
            clip_gradients(self.optimizer, self.clip_grad, grad_norm)
            self.optimizer.step_with_ready_grads()
            weights_changed(self)
        metrics = dict(metrics)
        metrics.update(loss=global_loss, grad_norm=grad_norm, skipped=0.0 if finite else 1.0)
        return metrics



def check_options(temperature: float, routing_replay: bool, recompute: str, optimizer_cpu_offload: bool) -> None:
    """ValueError naming the option a learner cannot take here."""
    if not temperature > 0:
        raise ValueError(f"temperature: {temperature} must be > 0 (the learner divides its logits by it)")
    if routing_replay and recompute == "full":
        raise ValueError("recompute: 'full' reruns the routers in the backward, where they would route on their "
                         "own instead of replaying (routing_replay); use 'selective' or 'none'")
    if optimizer_cpu_offload and not torch.cuda.is_available():
        raise ValueError("optimizer_cpu_offload: Megatron's HybridDeviceOptimizer moves optimizer states from the "
                         "GPU to the CPU and needs CUDA (streams, pinned memory); this torch has no CUDA device")


def resolve_spec(impl: str, attention: str, experts: str, te_fp8: bool, scheme: str, arch: Qwen3MoeArch,
                 parallel: ParallelConfig, dtype: torch.dtype) -> tuple[str, str, str]:
    """(layer spec, core attention, experts) a learner builds from model.impl, model.attention, model.experts
    (``moe.te.resolve_impl``, ``moe.attention.resolve_attention``, ``moe.grouped.resolve_experts``; the experts' choice
    depends on this rank's device and the parameters' dtype); model.te_fp8 checked against them."""
    from megatron_qarl.moe.grouped import resolve_experts

    impl = resolve_impl(impl, attention, experts)
    attention = resolve_attention(attention, impl)
    check_te_fp8(te_fp8, impl, scheme)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    experts = resolve_experts(experts, impl=impl, device=device, dtype=dtype, hidden=arch.hidden_size,
                              ffn_per_rank=arch.moe_intermediate_size // expert_tp(parallel.tp, parallel.ep))
    return impl, attention, experts


def dp_sum(value: torch.Tensor, dp_size: int) -> float:
    """Sum of the per-rank loss shares over data parallelism = the global loss."""
    from megatron.core import parallel_state as ps

    if dp_size == 1:
        return float(value)
    group = ps.get_data_parallel_group()
    v = to_group_device(value.detach().clone().float().reshape(1), group)
    all_reduce(v, group, name="loss")
    return v.item()


class _Replay:
    """One forward's use of Megatron's RouterReplay: replay ``routes_BSLK`` (this rank's rows, all positions),
    or record what the routers choose. Routers see hidden states [S_local, B, H] flattened position-major,
    S_local = this TP rank's chunk of the (padded) sequence under sequence parallelism."""

    def __init__(self, learner: Learner, shape_BS: torch.Size, routes_BSLK: torch.Tensor | None, record: bool):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        self.rr = RouterReplay
        self.replaying = routes_BSLK is not None
        b, s = shape_BS
        layers = learner.arch.num_hidden_layers
        if len(RouterReplay.global_router_replay_instances) != layers:
            raise RuntimeError(f"RouterReplay holds {len(RouterReplay.global_router_replay_instances)} routers, "
                               f"expected this model's {layers} (another model was built in this process)")
        sp = learner.parallel.sp and learner.tp > 1
        chunk = s // learner.tp if sp else s
        self.s0 = ps.get_tensor_model_parallel_rank() * chunk if sp else 0
        self.shape = (chunk, b, layers, learner.arch.num_experts_per_tok)
        if routes_BSLK is not None:  # [B, S (padded), L, K]
            local_SBLK = routes_BSLK[:, self.s0:self.s0 + chunk].transpose(0, 1).to(learner.device, torch.int64)
            RouterReplay.set_replay_data([local_SBLK[:, :, i].reshape(chunk * b, -1) for i in range(layers)])
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        elif record:
            RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)

    def recorded(self) -> torch.Tensor:
        """The expert ids this rank's routers used for its chunk: int64 [B, S_local, L, K] (recorded, or the
        replayed ones as each router holds them)."""
        chunk, b, layers, k = self.shape
        used = ([r.target_topk_idx for r in self.rr.global_router_replay_instances] if self.replaying
                else self.rr.get_recorded_data())
        per_layer = [t.view(chunk, b, k) for t in used]
        return torch.stack(per_layer, dim=2).transpose(0, 1).to(torch.int64)

    def close(self) -> None:
        self.rr.clear_global_router_replay_action()
        self.rr.clear_global_indices()  # set_target_indices also queues them for a backward replay we never run


def clip_gradients(optimizer, clip_grad: float, grad_norm: float) -> None:
    """Scale every gradient by clip_grad / grad_norm when below 1 (``grad_norm``: the global norm, dense + experts,
    already taken), as Megatron's ``MegatronOptimizer.clip_grad_norm`` does: the precision-aware optimizer
    (``learner.optimizer_cpu_offload``) holds its shards' gradients in ``.decoupled_grad`` and leaves ``.grad`` None,
    so the clip reads the attribute each optimizer's config names (``use_precision_aware_optimizer_no_fp8_or_ds_fp8``),
    else it would scale nothing. ``clip_grad`` 0: off."""
    from megatron.core.optimizer import optimizer as mopt

    if clip_grad <= 0:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = opt.get_parameters()
        if params:
            mopt.clip_grad_by_total_norm_fp32(
                params, max_norm=clip_grad, total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def weights_changed(learner: Learner) -> None:
    """Forget every cached derivative of a learner's parameters (the fake-quant codes, the exact kernels' K-major
    copies), after each optimizer step or weight load: the distributed optimizer all-gathers the parameters a rank
    does not own without bumping their ``_version``, so no cache keyed on it may outlive a weight change."""
    if learner.fake_quant:
        learner.fake_quant.invalidate()
    if learner.exact is not None:
        learner.exact.invalidate()


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
