"""Qwen3-MoE as a Megatron-Core GPTModel, built from a Hugging Face config.json.

The architecture (what Qwen3MoeForCausalLM computes):
  x = embed(tokens)
  per layer:  h = x + o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))   with RMSNorm before attention
              x = h + sum_{e in topk} p_e * down_e(silu(gate_e(n)) * up_e(n))  n = RMSNorm(h)
              p = softmax over the top-k router logits in fp32 (norm_topk_prob) or the top-k of a
              softmax over all logits (no renormalisation)
  logits = lm_head(RMSNorm(x))   (untied)
GQA with ``num_key_value_heads`` groups, head_dim from the config, RoPE base ``rope_theta``.

Parallelism is a construction-time property in Megatron: the model built here is the shard of the
calling rank for the tensor / sequence / expert parallel groups set up by
megatron_qarl.moe.parallelize.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_qarl.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeArch:
    """The fields of a Hugging Face Qwen3-MoE config.json that define the network."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    norm_topk_prob: bool
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> Qwen3MoeArch:
        """Read the architecture from a config.json dict; errors name the file and the key."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"{source}: not a Qwen3-MoE config: a JSON {type(cfg).__name__}, not an object")
        if cfg.get("model_type") != "qwen3_moe":
            raise ConfigError(f"{source}: not a Qwen3-MoE config: model_type is {cfg.get('model_type')!r}, expected "
                              "'qwen3_moe'")
        sparse_step = cfg.get("decoder_sparse_step", 1)
        if sparse_step != 1 or cfg.get("mlp_only_layers"):
            raise ConfigError(f"{source}: only all-MoE layers are supported "
                              f"(decoder_sparse_step=1, mlp_only_layers=[])")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
        rope_type = (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"{source}: rope scaling {rope_type!r} is not supported")
        values = {}
        for f in dataclasses.fields(cls):
            if f.name == "rope_theta":
                values[f.name] = rope_theta
            elif f.name == "head_dim":
                values[f.name] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            elif f.name in ("tie_word_embeddings", "attention_bias"):
                values[f.name] = bool(cfg.get(f.name, False))
            elif f.name == "norm_topk_prob":  # transformers' default is False
                values[f.name] = bool(cfg.get(f.name, False))
            elif f.name == "num_experts" and "num_experts" not in cfg:  # transformers 5 renamed it
                values[f.name] = cfg.get("num_local_experts")
            else:
                if cfg.get(f.name) is None:
                    raise ConfigError(f"{source}: missing key {f.name!r}")
                values[f.name] = cfg[f.name]
        if values["rope_theta"] is None:
            raise ConfigError(f"{source}: missing key 'rope_theta'")
        if values["tie_word_embeddings"]:
            raise ConfigError(f"{source}: tie_word_embeddings=true is not supported (Qwen3-MoE unties them)")
        return cls(**values)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Qwen3MoeArch:
        """The arch of a model directory's config.json; a ConfigError naming the file when it is missing, unreadable,
        no JSON or not a Qwen3-MoE."""
        path = Path(model_dir) / "config.json"
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found (expected a Hugging Face model directory)") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: unreadable: {type(err).__name__}: {err}") from None
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: line {err.lineno}: invalid JSON: {err.msg}") from None
        return cls.from_hf_config(cfg, str(path))


def expert_tp(tp: int, ep: int) -> int:
    """Expert tensor-parallel size: 1 with expert parallelism, else TP. Megatron sums expert
    gradients over expert-data-parallel groups only when EP > 1 (with EP = 1 the experts count as
    dense parameters), so TP > 1 with EP = 1 must shard the experts over TP as well."""
    return 1 if ep > 1 else tp


RECOMPUTE = ("none", "selective", "full")


def recompute_kwargs(recompute: str = "none", recompute_num_layers: int = 1) -> dict:
    """Megatron's activation-recompute settings (TransformerConfig) for ``learner.recompute``:

    none       every layer keeps its activations for the backward;
    selective  recompute_granularity="selective", recompute_modules=["core_attn"]: the core attention (the
               local spec's s^2 scores and softmax) is recomputed in the backward from q, k, v;
    full       recompute_granularity="full", recompute_method="uniform": only the input of each chunk of
               ``recompute_num_layers`` layers is kept; the backward reruns the chunk's forward.
    """
    if recompute not in RECOMPUTE:
        raise ConfigError(f"learner.recompute: {recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": recompute_num_layers}
    return {}


def transformer_config(arch: Qwen3MoeArch, *, tp: int = 1, ep: int = 1, sp: bool = False,
                       dtype: torch.dtype = torch.float32, dispatcher: str = "alltoall", routing_replay: bool = False,
                       recompute: str = "none", recompute_num_layers: int = 1):
    """The Megatron TransformerConfig equal to the Hugging Face architecture (fusions off: CPU-safe), with
    ``recompute_kwargs(recompute, recompute_num_layers)``."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=arch.num_hidden_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.num_experts_per_tok,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        # norm_topk_prob: softmax over the top-k logits == top-k of softmax, renormalised
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_enable_routing_replay=routing_replay,  # each router gets a RouterReplay (R3, learner.py)
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp(tp, ep),
        sequence_parallel=sp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **recompute_kwargs(recompute, recompute_num_layers),
    )


def layer_spec(arch: Qwen3MoeArch, attention: str = "sdpa", experts: str = "sequential"):
    """Megatron-Core local layer spec (no TE) with RMSNorm, qk-norm, the core attention ``attention``: "sdpa" torch's
    fused attention (``moe.attention.SDPAttention``), "unfused" Megatron's DotProductAttention (``model.attention``);
    and the experts: Megatron's SequentialMLP (``experts`` "sequential") or moe/grouped.py's GroupedExperts
    ("grouped"). Not Megatron's moe_grouped_gemm, which on this spec builds its legacy GroupedMLP (the grouped_gemm
    package: CUDA, bf16). ``build_model`` then gives its MoE layers the token dispatchers of moe/dispatch.py
    (Megatron's, the tokens permuted by a sort)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_qarl.moe.grouped import GroupedExperts

    if experts not in ("sequential", "grouped"):
        raise ValueError(f"experts: {experts!r} is not sequential or grouped")
    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts, moe_grouped_gemm=False,
                                     qk_layernorm=True, normalization="RMSNorm")
    from megatron_qarl.moe.megatron_cpu import RMSNorm

    sub = spec.submodules
    if experts == "grouped":
        sub.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    sub.self_attention.submodules.q_layernorm = RMSNorm
    sub.self_attention.submodules.k_layernorm = RMSNorm
    if attention == "sdpa":
        from megatron_qarl.moe.attention import SDPAttention

        sub.self_attention.submodules.core_attention = SDPAttention
    elif attention != "unfused":
        raise ValueError(f"attention: {attention!r} is not 'sdpa' or 'unfused' (the local spec's core attention)")
    return TransformerBlockSubmodules(layer_specs=[spec] * arch.num_hidden_layers, layer_norm=RMSNorm)


def build_model(arch: Qwen3MoeArch, *, tp: int = 1, ep: int = 1, sp: bool | None = None,
                dtype: torch.dtype = torch.float32, dispatcher: str = "alltoall", te: bool = False,
                te_fp8: bool = False, routing_replay: bool = False, recompute: str = "none",
                recompute_num_layers: int = 1, attention: str = "sdpa", experts: str = "sequential"):
    """This rank's shard of the Qwen3-MoE GPTModel. Parallel state must be initialised first.

    ``te`` False: Megatron's local layers (``layer_spec``, CPU-safe). True: Transformer Engine layers
    (``moe/te.py``; CUDA with TE installed, else ImportError naming the package), under TE's blockwise FP8
    autocast when ``te_fp8`` (``model.te_fp8``; ``moe.te.check_te_fp8`` says when it is allowed).
    ``routing_replay``: every router gets a Megatron ``RouterReplay``; they register in a process-global list
    in layer order, which is cleared first so that it holds this model's routers only.
    ``recompute``, ``recompute_num_layers``: activation recompute (``recompute_kwargs``). ``attention``: the local
    spec's core attention (``layer_spec``; ``moe.attention.resolve_attention``); the TE spec has its own.
    ``experts``: the local spec's experts, "sequential" or "grouped" (``moe.grouped.resolve_experts`` resolves
    model.experts); the TE spec has TE's grouped experts.
    """
    from megatron_qarl.moe import megatron_cpu

    megatron_cpu.apply()
    if sp is None:
        sp = tp > 1
    if te_fp8 and not te:
        raise ValueError("te_fp8: TE's FP8 GEMMs need the Transformer Engine layers (te=True)")
    config = transformer_config(arch, tp=tp, ep=ep, sp=sp, dtype=dtype, dispatcher=dispatcher,
                                routing_replay=routing_replay, recompute=recompute,
                                recompute_num_layers=recompute_num_layers)
    if not te:
        spec = layer_spec(arch, attention, experts)
    else:
        from megatron_qarl.moe.te import te_layer_spec, te_transformer_config

        config = te_transformer_config(config, te_fp8)
        spec = te_layer_spec(arch)
    if routing_replay:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()
    # on a GPU every parameter is created there: Megatron's own layers allocate on the current device, but its
    # router creates its weight on the CPU (moved at the first forward) and so does torch.nn.RMSNorm
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    with device or contextlib.nullcontext():
        model = _gpt_model(arch, config, spec)
    if not te:
        from megatron_qarl.moe.dispatch import sort_dispatch

        sort_dispatch(model)
    return model


def _gpt_model(arch: Qwen3MoeArch, config, spec):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rotary_percent=1.0,
    )


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's attention mask: True where attention is NOT allowed, shape [1, 1, s, s]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def attention_mask(attention: str, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The attention mask the model is called with: None for the sdpa core attention (its causal kernel reads no
    mask, so no s x s tensor is made), ``causal_mask`` for the unfused one and the TE spec."""
    return None if attention == "sdpa" else causal_mask(seq_len).to(device)


def forward_logits(model, tokens_BS: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [B, S, V] of this rank's model shard (gathered over TP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    seq = tokens_BS.shape[1]
    position_ids = torch.arange(seq).unsqueeze(0).expand_as(tokens_BS)
    logits = model(tokens_BS, position_ids, causal_mask(seq))
    if ps.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits
