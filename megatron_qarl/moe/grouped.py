"""A layer's routed experts as grouped GEMMs (``model.experts: grouped``): one parameter per projection, two grouped
matmuls, no per-expert loop.

For the E local experts of a layer, with the routed tokens already sorted by expert (moe/dispatch.py) and
``offs = cumsum(tokens_per_expert)`` on the device:

    h   = x @ W1_e^T            for the rows of each expert e      W1 = linear_fc1.weight [E, 2F/ETP, H]
    a   = silu(h_gate) * (h_up + glu_linear_offset)                 (Megatron MLP's GLU, its ops in its order)
    a   = (a * p).to(dtype)                                         p: each row's routing prob (fp32)
    y   = a @ W2_e^T            for the rows of each expert e      W2 = linear_fc2.weight [E, H, F/ETP]

each grouped matmul one ``torch.nn.functional.grouped_mm``. On CPU it runs one ``mm`` per expert inside the op,
so output, input gradient and weight gradients are bit for bit those of Megatron's ``SequentialMLP`` (its linears
compute ``x @ W^T``, ``g @ W`` and ``g^T @ x``); on CUDA sm90 / sm100 with bf16 operands it is one CUTLASS kernel
that reads the offsets on the device. Expert tensor parallelism is as ``SequentialMLP``'s: fc1 column-parallel,
fc2 row-parallel, no communication inside (the dispatcher gathers and reduce-scatters over the expert-TP group).

The parameters carry Megatron's attributes of expert linears (``allreduce`` False under expert parallelism, so DDP
and the distributed optimizer reduce them over the expert-data-parallel group; ``tensor_model_parallel``), and the
module's dist-checkpoint speaks ``SequentialMLP``'s keys: each local expert's rows are the ShardedTensors
``SequentialMLP``'s linears would make (``sharded_state_dict``), so a checkpoint written by either loads into the
other (the optimizer's too where its format is model-space: learner/checkpoint.py).

torch's grouped matmul wants every operand stride a multiple of 16 bytes (``check_shapes``), and its meta kernel
takes bf16 only (the simulated device runs fp32 on it as bf16: gpu/simulated_device.py).
"""

from __future__ import annotations

import copy
import functools
import re

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from megatron_qarl.errors import ConfigError
from megatron_qarl.qat.config import quant_sequential_mlp_applies

EXPERTS = ("auto", "sequential", "grouped")  # model.experts


def check_shapes(hidden: int, ffn_per_rank: int, dtype: torch.dtype) -> str | None:
    """Why torch's grouped matmul cannot take these shapes (None: it can): every row of its operands (H, F/ETP
    elements) must be a multiple of 16 bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    for name, n in (("hidden_size", hidden), ("moe_intermediate_size / expert-TP", ffn_per_rank)):
        if n * size % 16:
            return f"{name} = {n} elements of {size} bytes is not a multiple of 16 bytes (torch's grouped_mm)"
    return None


def _no_fast_path(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why torch's grouped matmul on ``device`` would not be one kernel with device-side offsets (None: it is)."""
    if device.type == "cpu":
        return None  # one mm per expert inside the op: the same cost as SequentialMLP's linears, no Python loop
    if device.type != "cuda":
        return f"no grouped_mm kernel on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"this GPU (sm_{major}{minor}): torch {torch.__version__}'s grouped_mm is one kernel on sm_90 and "
                "sm_100 only (elsewhere it loops over the experts and copies the offsets to the host in every "
                "layer), and on sm_100 it gives an expert with no token a non-zero weight gradient "
                "(pytorch/pytorch#172439, open)")
    if dtype != torch.bfloat16:
        return (f"{dtype} parameters: torch's grouped_mm is one kernel for bfloat16 operands only (model.dtype "
                "bfloat16); otherwise it loops over the experts and copies the offsets to the host in every layer")
    return None


def resolve_experts(choice: str, *, impl: str, device: torch.device, dtype: torch.dtype, hidden: int,
                    ffn_per_rank: int) -> str:
    """``model.experts`` on a learner: "te" on the Transformer Engine spec (its TEGroupedMLP), else "sequential"
    (Megatron's SequentialMLP) or "grouped" (this module). ``auto`` is grouped where torch's grouped matmul is
    bit-equal and fast (the CPU; CUDA sm90 with bfloat16 parameters: ``_no_fast_path``) and the shapes allow it
    (``check_shapes``), else sequential; an explicit ``grouped`` where it is not is refused, saying why."""
    if choice not in EXPERTS:
        raise ConfigError(f"model.experts: {choice!r} is not one of {', '.join(EXPERTS)}")
    if impl == "te":
        if choice != "auto":
            raise ConfigError(f"model.experts: {choice} chooses the local spec's experts, but model.impl is te (its "
                              "experts are Transformer Engine's grouped GEMMs, TEGroupedMLP); use model.experts=auto "
                              "or model.impl=local")
        return "te"
    if choice == "sequential":
        return choice
    why = check_shapes(hidden, ffn_per_rank, dtype) or _no_fast_path(device, dtype)
    if why is None:
        return "grouped"
    if choice == "grouped":
        raise ConfigError(f"model.experts: grouped: {why}; use model.experts=auto or sequential")
    return "sequential"


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward refuses a stride-0 one (the
    gradient of ``y.sum()``, an expanded scalar)."""

    @staticmethod
    def forward(ctx, y: Tensor) -> Tensor:  # noqa: ARG004
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: ARG004
        # an empty expanded gradient is "contiguous" with zero strides, which grouped_mm refuses too: a copy
        return grad.clone(memory_format=torch.contiguous_format) if grad.numel() == 0 else grad.contiguous()


def grouped_linear(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """y[rows of e] = x[rows of e] @ weight[e]^T: ``x`` [T, K] sorted by expert, ``weight`` [E, N, K], ``offs`` int32
    [E] the cumulative row counts (on x's device); [T, N]."""
    return _DenseGrad.apply(F.grouped_mm(x, weight.transpose(-2, -1), offs=offs))


class GroupedLinear(torch.nn.Module):
    """The same projection of E experts, ``weight`` [E, output_size, input_size]; ``forward(x, offs)`` is
    ``grouped_linear``. ModelOpt converts it as a linear (qat/modules.py registers ``QuantGroupedLinear``): its
    input quantizer sees the layer's routed tokens at once, its weight quantizer the whole stack."""

    def __init__(self, experts: int, output_size: int, input_size: int, config):
        super().__init__()
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(experts, output_size, input_size, dtype=config.params_dtype,
                                                     device=device))

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        return grouped_linear(x, self.weight, offs)


class GroupedExperts(MegatronModule):
    """The local experts of one MoE layer in ``SequentialMLP``'s place (the local layer spec, moe/model.py): the same
    constructor and forward signatures, parameters ``linear_fc1.weight`` [E, 2F/ETP, H] and ``linear_fc2.weight``
    [E, H, F/ETP] (each expert's rows as ``SequentialMLP``'s expert holds them: [gate_r; up_r] and down's K chunk)."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None):  # noqa: ARG002
        cfg = copy.deepcopy(config) if config.moe_ffn_hidden_size != config.ffn_hidden_size else config
        cfg.ffn_hidden_size = config.moe_ffn_hidden_size
        super().__init__(config=cfg)
        if cfg.use_te_activation_func or cfg.bias_activation_fusion or cfg.add_bias_linear or cfg.fp8 or cfg.fp4:
            raise ConfigError("model.experts: grouped computes Megatron's unfused GLU without biases in the "
                              "parameters' precision (use_te_activation_func, bias_activation_fusion, "
                              "add_bias_linear, fp8 / fp4 off)")
        if cfg.recompute_granularity == "selective" and "moe_act" in (cfg.recompute_modules or []):
            raise ConfigError("model.experts: grouped does not recompute its activation (Megatron's 'moe_act' "
                              "recompute module); use model.experts=sequential or another recompute")
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        etp, etp_rank = self.tp_group.size(), self.tp_group.rank()
        ffn, hidden = cfg.moe_ffn_hidden_size, cfg.hidden_size
        fc1_rows = 2 * ffn if cfg.gated_linear_unit else ffn
        why = check_shapes(hidden, ffn // etp, cfg.params_dtype)
        if why:
            raise ConfigError(f"model.experts: grouped: {why}; use model.experts=sequential")
        self.linear_fc1 = GroupedLinear(num_local_experts, fc1_rows // etp, hidden, cfg)
        self.linear_fc2 = GroupedLinear(num_local_experts, hidden, ffn // etp, cfg)
        expert_parallel = cfg.expert_model_parallel_size > 1
        for linear, dim, stride in ((self.linear_fc1, 1, 2 if cfg.gated_linear_unit else 1), (self.linear_fc2, 2, 1)):
            w = linear.weight
            w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, dim, stride
            w.allreduce = not expert_parallel  # Megatron's expert linears: reduced over expert DP under EP
        if cfg.perform_initialization:
            self._initialize(fc1_rows, ffn, etp, etp_rank)
        self.register_load_state_dict_post_hook(_ignore_extra_states)

    @torch.no_grad()
    def _initialize(self, fc1_rows: int, ffn: int, etp: int, etp_rank: int) -> None:
        """Each expert's weights as SequentialMLP's expert linears draw them, in its order (fc1 then fc2 of expert 0,
        then of expert 1, ...): the same model for the same seed."""
        from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        cfg, hidden = self.config, self.config.hidden_size
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        for e in range(self.num_local_experts):
            if cfg.use_cpu_initialization:
                _initialize_affine_weight_cpu(w1[e], fc1_rows, hidden, fc1_rows // etp, 0, cfg.init_method,
                                              stride=w1.partition_stride, params_dtype=cfg.params_dtype,
                                              rank=etp_rank, world_size=etp, skip_set_tensor_parallel_attributes=True)
                _initialize_affine_weight_cpu(w2[e], hidden, ffn, ffn // etp, 1, cfg.output_layer_init_method,
                                              params_dtype=cfg.params_dtype, rank=etp_rank, world_size=etp,
                                              skip_set_tensor_parallel_attributes=True)
            else:
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    cfg.init_method(w1[e])
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    cfg.output_layer_init_method(w2[e])

    def forward(self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor, permuted_probs: Tensor):
        """(output [T, H], None) for the rows sorted by expert; ``tokens_per_expert`` [E] may stay on the device."""
        cfg, x, probs = self.config, permuted_local_hidden_states, permuted_probs
        if cfg.moe_apply_probs_on_input:  # as SequentialMLP
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        offs = torch.cumsum(tokens_per_expert.to(x.device, non_blocking=True), 0, dtype=torch.int32)
        h = self.linear_fc1(x, offs)
        if cfg.gated_linear_unit:  # Megatron MLP's glu, op for op
            gate, up = torch.chunk(h, 2, dim=-1)
            if (clamp := cfg.activation_func_clamp_value) is not None:
                gate, up = gate.clamp(min=None, max=clamp), up.clamp(min=-clamp, max=clamp)
            h = cfg.activation_func(gate) * (up + cfg.glu_linear_offset)
        else:
            h = cfg.activation_func(h)
        h = (h * probs.unsqueeze(-1)).to(h.dtype)
        return self.linear_fc2(h, offs), None

    def backward_dw(self) -> None:
        """Weight gradients are not deferred here (Megatron's delayed-wgrad hook, as its legacy GroupedMLP)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """``SequentialMLP``'s dist-checkpoint entries, each expert's from its rows of the stacked parameters: one
        ShardedTensorFactory per parameter builds, from whatever tensor of the parameter's shape it is handed (the
        weights, or an optimizer state of the model-space formats), the ShardedTensors of every local expert under
        SequentialMLP's keys and offsets, and stacks them back on load; ``_extra_state`` entries as its linears'.

        A quantized learner's keys follow what ModelOpt 0.47's plugins (plugins/megatron.py) make SequentialMLP write:
        its QuantSequentialMLP (where it applies: ``quant_sequential_mlp_applies``) sets
        ``metadata["singleton_local_shards"]`` (each expert under a key of its global index, ``experts.E.``), and each
        expert's QuantMLP sets it for its own linears (fc1's SwiGLU halves as ``_w`` / ``_v`` keys) where the
        container did not; both set it in the dict every later layer is handed, so the layers after the first write
        singleton keys. The same happens here, so either implementation writes the same checkpoint at any layout
        (tests/test_grouped_experts.py)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        quantized = hasattr(self.linear_fc1, "weight_quantizer")
        if self._quantized_by_modelopt():
            metadata["singleton_local_shards"] = True  # QuantSequentialMLP's, in the dict it is handed
        single = bool(metadata.get("singleton_local_shards", False))
        halves_single = single or quantized  # each expert's QuantMLP: its SwiGLU halves under keys of their own
        out = {}
        for name in ("linear_fc1", "linear_fc2"):
            build = functools.partial(self._expert_tensors, name, sharded_offsets, metadata, single, halves_single)
            out[f"{prefix}{name}.weight"] = ShardedTensorFactory(f"{prefix}experts.{name}.weight",
                                                                 getattr(self, name).weight, build, _stack_experts,
                                                                 (0, 0, self.dp_group.rank()))
        for e in range(self.num_local_experts):
            extra = {f"{name}._extra_state": None for name in ("linear_fc1", "linear_fc2")}
            local = f"{prefix}local_experts.{e}."
            sd = make_sharded_tensors_for_checkpoint(extra, local, {}, self._expert_offsets(e, sharded_offsets, single),
                                                     tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
            for k, obj in sd.items():
                obj.key = self._expert_prefix(e, prefix, single) + obj.key[len(local):]
                obj.replica_id = (*obj.replica_id[:2], self.dp_group.rank())
                out[f"{prefix}expert{e}.{k[len(local):]}"] = obj
        if quantized:
            metadata["singleton_local_shards"] = True  # as each expert's QuantMLP leaves it for the layers after
        return out

    def _quantized_by_modelopt(self) -> bool:
        """Whether this layer's experts would be ModelOpt's QuantSequentialMLP with sequential experts (quantized, and
        a layout ModelOpt's plugin takes: ``quant_sequential_mlp_applies``), which writes singleton keys."""
        if not hasattr(self.linear_fc1, "weight_quantizer"):
            return False
        return quant_sequential_mlp_applies(self.config.tensor_model_parallel_size,
                                            self.config.expert_model_parallel_size)

    def _global(self, e: int) -> int:
        return self.ep_group.rank() * self.num_local_experts + e

    def _expert_prefix(self, e: int, prefix: str, single: bool) -> str:
        return f"{prefix}experts.{self._global(e)}." if single else f"{prefix}experts."

    def _expert_offsets(self, e: int, sharded_offsets: tuple, single: bool) -> tuple:
        if single:
            return sharded_offsets
        n_global = self.ep_group.size() * self.num_local_experts
        return (*sharded_offsets, (len(sharded_offsets), self._global(e), n_global))

    def _expert_tensors(self, name: str, sharded_offsets: tuple, metadata: dict, single: bool, halves_single: bool,
                        key: str, t: Tensor, replica_id, flattened_range) -> list:
        """The ShardedTensors of each local expert's rows of ``t`` (``name``'s shape) under ``key`` (the weight's,
        or an optimizer state's: its prefix is kept): as SequentialMLP builds them (its linears'
        make_sharded_tensors_for_checkpoint, fc1's SwiGLU halves, its keys and replica ids)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if flattened_range is not None:
            raise NotImplementedError(f"{key}: flattened ShardedTensors (optimizer format fully_sharded_model_space)")
        axis = 0 if name == "linear_fc1" else 1
        experts = []
        for e in range(self.num_local_experts):
            offsets = self._expert_offsets(e, sharded_offsets, single)
            sh = make_sharded_tensors_for_checkpoint({"w": t[e]}, "", {"w": axis}, offsets, tp_group=self.tp_group,
                                                     dp_cp_group=metadata["dp_cp_group"])["w"]
            # the key as handed in (Megatron's TransformerBlock may have renamed the factory's, an optimizer prefixed
            # it): its own ``experts.linear_fcN.weight`` end gets the expert's global index where experts are singletons
            end = f"experts.{name}.weight"
            head = key[: -len(end)] if key.endswith(end) else None
            if head is None:
                raise ValueError(f"{key}: a grouped expert key ends with {end}")
            sh.key = head + (f"experts.{self._global(e)}.{name}.weight" if single else end)
            sh.replica_id = (*replica_id[:2], self.dp_group.rank())
            if name == "linear_fc1" and self.config.gated_linear_unit:
                experts.append(apply_swiglu_sharded_factory(sh, offsets, halves_single).build())
            else:
                experts.append([sh])
        return experts


@torch.no_grad()
def _stack_experts(loaded: list) -> Tensor:
    """The loaded experts (each its list of parts: fc1's gate and up halves) stacked back into the parameter."""
    return torch.stack([torch.cat(parts) if len(parts) > 1 else parts[0] for parts in loaded])


def _ignore_extra_states(module: torch.nn.Module, incompatible) -> None:  # noqa: ARG001
    """The ``_extra_state`` entries written for SequentialMLP's sake (``sharded_state_dict``) have no module here."""
    for key in list(incompatible.unexpected_keys):
        if key.endswith("_extra_state") and re.search(r"\.expert\d+\.linear_fc[12]\._extra_state$", key):
            incompatible.unexpected_keys.remove(key)
