"""Inert stand-ins for the Transformer Engine classes Megatron-Core 0.16.1's TE layer spec names, so that the spec
Megatron's own code declares (``get_gpt_layer_with_transformer_engine_spec``) can be built into a model on a
machine without TE (tests/test_te_spec.py).

Each stand-in registers the parameters its TE class registers, under the same names and shapes, and computes what
the TE module computes (in plain torch, no FP8), so a model built from the spec both names its parameters as the TE
model does and gives the same logits as Megatron's local spec on the same weights. The parameter names are TE's
(TransformerEngine, ``transformer_engine/pytorch/module/``):

- ``layernorm_linear.py`` LayerNormLinear: ``layer_norm_weight`` [in] (and ``layer_norm_bias`` for LayerNorm only,
  not RMSNorm), ``weight`` [out, in] (bias only when bias=True) -- Megatron's TELayerNormColumnParallelLinear;
- ``linear.py`` Linear: ``weight`` -- TEColumnParallelLinear / TERowParallelLinear, which Megatron's own
  Column/RowParallelLinear (same ``weight`` name and TP sharding) stand in for;
- ``rmsnorm.py`` RMSNorm: ``weight`` -- TENorm with normalization="RMSNorm";
- ``grouped_linear.py`` GroupedLinear: ``weight0`` .. ``weight{n-1}`` [out, in] per GEMM, after dividing the
  parallel dimension by the expert-TP size -- Megatron's TEColumnParallelGroupedLinear / TERowParallelGroupedLinear;
- ``attention`` DotProductAttention: no parameters -- Megatron's local DotProductAttention stands in.

``install(monkeypatch)`` puts them where Megatron's TE spec provider and its transformer block look them up, and
makes ``get_gpt_layer_with_transformer_engine_spec`` callable without TE (megatron-core 0.16.1 only binds
``TESpecProvider`` in gpt_layer_specs when ``import transformer_engine`` succeeds).
"""

from __future__ import annotations

import torch

from megatron_qarl.megatron_cpu import RMSNorm


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


class TENormStandIn(RMSNorm):
    """TENorm(config, hidden_size, eps) with config.normalization == "RMSNorm": TE's RMSNorm, parameter ``weight``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        if config.normalization != "RMSNorm":
            raise ValueError("the stand-in covers RMSNorm only (Qwen3-MoE)")
        super().__init__(config, hidden_size, eps)


def _column_parallel_linear():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return ColumnParallelLinear


class TELayerNormColumnParallelLinearStandIn(torch.nn.Module):
    """TE LayerNormLinear as Megatron wraps it: RMSNorm over the input (``layer_norm_weight``), then a column-parallel
    linear (``weight``, [output_size / TP, input_size]). Same constructor arguments as Megatron's
    TELayerNormColumnParallelLinear; forward returns (output, None) like it."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool, bias: bool,
                 skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group=None, stride: int = 1):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError("the stand-in covers RMSNorm only (Qwen3-MoE)")
        linear = _column_parallel_linear()(input_size, output_size, config=config, init_method=init_method,
                                           bias=bias, gather_output=gather_output, skip_bias_add=skip_bias_add,
                                           is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name,
                                           tp_group=tp_group, stride=stride)
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.layer_norm_weight.sequence_parallel = config.sequence_parallel
        # TE holds the linear's weight on this module itself: take Megatron's (initialised, TP-tagged) parameter
        # over and keep the linear only for its computation (a list: not a submodule)
        self.weight = linear.weight
        linear.weight = None
        self._linear = [linear]

    def forward(self, x: torch.Tensor):
        return self._linear[0](_rms_norm(x, self.layer_norm_weight, self.eps), weight=self.weight)


class _GroupedLinearStandIn(torch.nn.Module):
    """TE GroupedLinear as Megatron wraps it for experts: ``weight<i>`` [out, in] per local expert (the parallel
    dimension already divided by the expert-TP size); forward(x, m_splits) multiplies each expert's rows by its
    weight and returns (output, None)."""

    parallel_mode = ""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str | None = None,
                 pg_collection=None):
        super().__init__()
        if bias:
            raise ValueError("the stand-in covers bias=False only (Qwen3-MoE)")
        etp = pg_collection.expt_tp.size() if pg_collection is not None else 1
        if self.parallel_mode == "column":
            output_size //= etp
        else:
            input_size //= etp
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            init_method(w)
            w.allreduce = not (is_expert and config.expert_model_parallel_size > 1)
            self.register_parameter(f"weight{i}", w)

    def forward(self, x: torch.Tensor, m_splits: list[int]):
        parts = torch.split(x, list(m_splits))
        out = [p @ getattr(self, f"weight{i}").t() for i, p in enumerate(parts)]
        return torch.cat(out) if out else x.new_zeros(0, 0), None


class TEColumnParallelGroupedLinearStandIn(_GroupedLinearStandIn):
    parallel_mode = "column"


class TERowParallelGroupedLinearStandIn(_GroupedLinearStandIn):
    parallel_mode = "row"


def _dot_product_attention_standin():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class TEDotProductAttentionStandIn(DotProductAttention):
        """TE DotProductAttention has no parameters; Megatron's local one computes the same softmax attention."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, num_splits=None, cp_comm_type="p2p",
                     pg_collection=None):
            super().__init__(config, layer_number, attn_mask_type, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                             cp_comm_type=cp_comm_type, pg_collection=pg_collection)

    return TEDotProductAttentionStandIn


def install(monkeypatch) -> None:
    """Bind the stand-ins where megatron-core 0.16.1 looks the TE classes up (pytest's ``monkeypatch`` undoes it)."""
    import megatron.core.extensions.transformer_engine_spec_provider as provider
    import megatron.core.models.gpt.gpt_layer_specs as gpt_layer_specs
    import megatron.core.transformer.transformer_block as transformer_block
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(provider, "is_te_min_version", lambda *_a, **_k: True)  # a current TE (>= 2.4)
    for name, cls in {"TENorm": TENormStandIn,
                      "TELayerNormColumnParallelLinear": TELayerNormColumnParallelLinearStandIn,
                      "TEColumnParallelLinear": _column_parallel_linear(),
                      "TERowParallelLinear": RowParallelLinear,
                      "TEDotProductAttention": _dot_product_attention_standin(),
                      "TEColumnParallelGroupedLinear": TEColumnParallelGroupedLinearStandIn,
                      "TERowParallelGroupedLinear": TERowParallelGroupedLinearStandIn}.items():
        monkeypatch.setattr(provider, name, cls)
    # the block's final norm: TENorm where TE imports (transformer_block.LayerNormImpl)
    monkeypatch.setattr(transformer_block, "LayerNormImpl", TENormStandIn)
