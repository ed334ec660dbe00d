"""Hugging Face Qwen3-MoE <-> Megatron-Core parameter names and shards, for any TP / EP layout.

One table (`param_maps`) states, for every Megatron parameter of this rank, the Hugging Face tensors
it comes from and how they are split:
  replicated  norms, q/k norms, router            same tensor on every rank
  tp_row      embedding, lm_head                  split along dim 0 over TP
  tp_col      o_proj (linear_proj)                split along dim 1 over TP
  qkv         q/k/v_proj -> linear_qkv            per KV group g: [q heads of g; k_g; v_g], TP splits
                                                  whole groups
  fc1         experts.E.{gate,up}_proj -> local_experts.e.linear_fc1   [gate_r; up_r] stacked (dim 0),
              gate and up each split along dim 0 over expert-TP (ETP)
  fc2         experts.E.down_proj -> local_experts.e.linear_fc2        split along dim 1 over ETP
Global expert E = e + ep_rank * (num_experts / ep). ETP is 1 when EP > 1 and equals TP otherwise
(megatron_qarl.moe.model.expert_tp), as Megatron sums expert gradients only over expert groups.

Two Megatron layer specs name these parameters differently (``impl``; megatron-core 0.16.1's
``gpt_layer_specs.get_gpt_layer_local_spec`` / ``get_gpt_layer_with_transformer_engine_spec``):

  HF tensor(s) of layer L        local spec (impl="local")                 TE spec (impl="te")
  input_layernorm                input_layernorm.weight                    self_attention.linear_qkv.layer_norm_weight
  self_attn.{q,k,v}_proj         self_attention.linear_qkv.weight          same
  self_attn.o_proj               self_attention.linear_proj.weight         same
  self_attn.{q,k}_norm           self_attention.{q,k}_layernorm.weight     same
  post_attention_layernorm       pre_mlp_layernorm.weight                  same (a separate TENorm)
  mlp.gate                       mlp.router.weight                         same
  mlp.experts.E.{gate,up}_proj   mlp.experts.local_experts.e.linear_fc1.weight   mlp.experts.linear_fc1.weight<e>
  mlp.experts.E.down_proj        mlp.experts.local_experts.e.linear_fc2.weight   mlp.experts.linear_fc2.weight<e>
(module paths under decoder.layers.L.; embedding, final norm and output layer are named alike in both.)

With ``model.experts: grouped`` the local spec's experts are one parameter per projection (moe/grouped.py):
``mlp.experts.linear_fc1.weight`` [E_local, 2F/ETP, H] and ``mlp.experts.linear_fc2.weight`` [E_local, H, F/ETP],
each expert's rows as SequentialMLP's expert holds them; its maps are ``stacked`` (the tensor is row ``expert`` of the
parameter, ``param_tensor``). ``impl`` names the three parameter layouts: "local" (SequentialMLP), "grouped", "te".

The TE spec folds the attention RMSNorm into TELayerNormColumnParallelLinear (``layer_norm_weight``); for MoE
layers it keeps ``pre_mlp_layernorm`` a separate TENorm (the router reads the normed input, and the experts are
plain TE grouped linears with no norm to fold into); TEGroupedMLP holds one ``weight<e>`` per local expert. Split
kinds and tensor layouts are the same in both specs, so everything keyed on ``ParamMap.split`` works unchanged.
tests/test_te_spec.py checks both tables against the modules Megatron's own spec code builds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from megatron_qarl.errors import UserError
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.model_dir import check_weights
from megatron_qarl.moe.parallelize import all_gather_tensors, to_group_device

# the parameter layouts param_maps names: Megatron's local spec with SequentialMLP experts, with grouped experts
# (model.experts: grouped), its Transformer Engine spec (model.impl te)
IMPLS = ("local", "grouped", "te")


@dataclasses.dataclass(frozen=True)
class ParamMap:
    mcore: str  # "<module path>.<parameter name>" in the Megatron model
    hf: tuple[str, ...]
    split: str  # replicated | tp_row | tp_col | qkv | fc1 | fc2
    expert: int | None = None  # fc1 / fc2: the local expert index e on this EP rank
    stacked: bool = False  # the Megatron parameter holds every local expert: this map is its row ``expert``


def param_tensor(params: Mapping[str, torch.Tensor], pm: ParamMap) -> torch.Tensor:
    """``pm``'s Megatron tensor from the model's parameters by name: the parameter, or its row ``pm.expert`` (a view)
    where it stacks the layer's experts."""
    p = params[pm.mcore]
    return p[pm.expert] if pm.stacked else p


@dataclasses.dataclass(frozen=True)
class Layout:
    """This rank's coordinates: tensor, expert and expert-tensor parallel rank and size."""

    tp_rank: int = 0
    tp: int = 1
    ep_rank: int = 0
    ep: int = 1
    etp_rank: int = 0
    etp: int = 1

    @classmethod
    def current(cls) -> Layout:
        from megatron.core import parallel_state as ps

        return cls(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                   ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())


def param_maps(arch: Qwen3MoeArch, ep_rank: int = 0, ep: int = 1, impl: str = "local") -> Iterator[ParamMap]:
    """Every parameter of one TP/EP rank's Megatron model and its Hugging Face sources, named as the ``impl``
    layer spec names them ("local": Megatron's local spec, "te": its Transformer Engine spec)."""
    if impl not in IMPLS:
        raise ValueError(f"impl: {impl!r} is not one of {IMPLS}")
    te, grouped = impl == "te", impl == "grouped"
    yield ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "tp_row")
    n_local = arch.num_experts // ep
    for L in range(arch.num_hidden_layers):
        m, h = f"decoder.layers.{L}.", f"model.layers.{L}."
        input_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
        yield ParamMap(m + input_norm, (h + "input_layernorm.weight",), "replicated")
        yield ParamMap(m + "self_attention.linear_qkv.weight",
                       tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv")
        yield ParamMap(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "tp_col")
        yield ParamMap(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), "replicated")
        yield ParamMap(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), "replicated")
        yield ParamMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated")
        yield ParamMap(m + "mlp.router.weight", (h + "mlp.gate.weight",), "replicated")
        for e in range(n_local):
            E = e + ep_rank * n_local
            he = h + f"mlp.experts.{E}."
            if te:
                fc1, fc2 = f"mlp.experts.linear_fc1.weight{e}", f"mlp.experts.linear_fc2.weight{e}"
            elif grouped:
                fc1, fc2 = "mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight"
            else:
                fc1 = f"mlp.experts.local_experts.{e}.linear_fc1.weight"
                fc2 = f"mlp.experts.local_experts.{e}.linear_fc2.weight"
            yield ParamMap(m + fc1, (he + "gate_proj.weight", he + "up_proj.weight"), "fc1", e, grouped)
            yield ParamMap(m + fc2, (he + "down_proj.weight",), "fc2", e, grouped)
    yield ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")
    yield ParamMap("output_layer.weight", ("lm_head.weight",), "tp_row")


def model_impl(model) -> str:
    """The parameter layout of ``model`` (``IMPLS``): "te" when its attention has TE's fused norm + QKV linear,
    "grouped" when its experts are moe/grouped.py's, else "local"; so that the table follows the model it is used on."""
    names = [n for n, _ in model.named_parameters()]
    if any(n.endswith("self_attention.linear_qkv.layer_norm_weight") for n in names):
        return "te"
    return "grouped" if any(n.endswith("mlp.experts.linear_fc1.weight") for n in names) else "local"


def layer_spec_of(impl: str) -> str:
    """The Megatron layer spec (model.impl: local | te) of a parameter layout: grouped experts are the local spec's."""
    return "te" if impl == "te" else "local"


def _qkv_groups(arch: Qwen3MoeArch) -> tuple[int, int]:
    """(rows per KV group in linear_qkv, q rows per group)."""
    q_per_group = arch.num_attention_heads // arch.num_key_value_heads * arch.head_dim
    return q_per_group + 2 * arch.head_dim, q_per_group


def hf_to_shard(pm: ParamMap, get: Callable[[str], torch.Tensor], arch: Qwen3MoeArch,
                lay: Layout) -> torch.Tensor:
    """This rank's Megatron tensor for ``pm`` from Hugging Face tensors (``get(name)``)."""
    if pm.split == "replicated":
        return get(pm.hf[0])
    if pm.split == "fc1":
        return torch.cat([get(n).chunk(lay.etp, dim=0)[lay.etp_rank] for n in pm.hf], dim=0)
    if pm.split == "fc2":
        return get(pm.hf[0]).chunk(lay.etp, dim=1)[lay.etp_rank]
    tp, tp_rank = lay.tp, lay.tp_rank
    if pm.split in ("tp_row", "tp_col"):
        return get(pm.hf[0]).chunk(tp, dim=0 if pm.split == "tp_row" else 1)[tp_rank]
    # qkv: [G, q_rows + 2*hd, H] interleaved, then whole groups per TP rank
    q, k, v = (get(n) for n in pm.hf)
    g, hd = arch.num_key_value_heads, arch.head_dim
    hidden = q.shape[1]
    qkv = torch.cat([q.view(g, -1, hidden), k.view(g, hd, hidden), v.view(g, hd, hidden)], dim=1)
    return qkv.chunk(tp, dim=0)[tp_rank].reshape(-1, hidden)


def shards_to_hf(pm: ParamMap, shards: list[torch.Tensor], arch: Qwen3MoeArch) -> dict[str, torch.Tensor]:
    """Hugging Face tensors for ``pm`` from the list of its TP (or ETP) shards, in rank order."""
    if pm.split == "replicated":
        return {pm.hf[0]: shards[0]}
    if pm.split == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return {pm.hf[0]: torch.cat([h[0] for h in halves]), pm.hf[1]: torch.cat([h[1] for h in halves])}
    if pm.split in ("tp_row", "tp_col", "fc2"):
        return {pm.hf[0]: torch.cat(shards, dim=0 if pm.split == "tp_row" else 1)}
    rows, q_rows = _qkv_groups(arch)
    hidden = shards[0].shape[1]
    qkv = torch.cat([s.view(-1, rows, hidden) for s in shards], dim=0)
    hd = arch.head_dim
    q, k, v = qkv.split([q_rows, hd, hd], dim=1)
    return {pm.hf[0]: q.reshape(-1, hidden), pm.hf[1]: k.reshape(-1, hidden), pm.hf[2]: v.reshape(-1, hidden)}


class SafetensorsDir:
    """Lazy access to the tensors of a Hugging Face safetensors directory (single or sharded)."""

    def __init__(self, model_dir: str | Path):
        """Every weight file is checked first (``moe.model_dir.check_weights``: a truncated shard, an index naming
        a missing one, is a UserError naming the file)."""
        from safetensors import SafetensorError, safe_open

        self.dir = Path(model_dir)
        self._handles = {}
        self._where: dict[str, str] = {}
        for path in check_weights(self.dir):
            try:
                handle = safe_open(str(path), framework="pt")
            except SafetensorError as err:
                raise UserError(f"{path}: unreadable safetensors file: {err}") from None
            self._handles[path.name] = handle
            for key in handle.keys():
                self._where[key] = path.name

    def keys(self) -> list[str]:
        return list(self._where)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.dir}: tensor {name!r} not found in the checkpoint")
        return self._handles[self._where[name]].get_tensor(name)


@torch.no_grad()
def load_hf_into_model(model, arch: Qwen3MoeArch, hf: Mapping[str, torch.Tensor]) -> None:
    """Copy Hugging Face weights into this rank's Megatron model shard (every parameter checked)."""
    lay = Layout.current()
    params = dict(model.named_parameters())
    seen = set()
    for pm in param_maps(arch, lay.ep_rank, lay.ep, model_impl(model)):
        if pm.mcore not in params:
            raise KeyError(f"Megatron model has no parameter {pm.mcore!r}")
        src = hf_to_shard(pm, hf.__getitem__, arch, lay)
        dst = param_tensor(params, pm)
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{pm.hf} -> {pm.mcore}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
        dst.copy_(src.to(dst.dtype))
        seen.add(pm.mcore)
    missing = set(params) - seen
    if missing:
        raise KeyError(f"parameters with no Hugging Face source: {sorted(missing)[:5]}")


def peer_expert_name(name: str, pm: ParamMap, lay: Layout, n_local: int, peer_ep_rank: int) -> str:
    """The Hugging Face name of ``name`` (one of this rank's experts) for the same local expert slot
    on EP rank ``peer_ep_rank``: global expert e_local + ep_rank * n_local."""
    e_local = pm.expert
    return name.replace(f"experts.{e_local + lay.ep_rank * n_local}.", f"experts.{e_local + peer_ep_rank * n_local}.")


@torch.no_grad()
def iter_hf_tensors(model, arch: Qwen3MoeArch, *, all_experts: bool = True,
                    include: Callable[[ParamMap], bool] | None = None,
                    groups=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: yield (Hugging Face name, full tensor) for the whole model on every rank.

    TP shards are all-gathered; with ``all_experts`` each EP rank's experts are all-gathered over
    the EP group too, otherwise every rank yields only its own experts (what a weight broadcaster
    from several EP ranks needs). ``include`` selects parameters (same answer on every rank). All
    ranks must iterate in step. ``groups`` (``parallelize.SyncGroups``: the weight sync's own, with its bound):
    the TP / ETP / EP groups the gathers run on; None: Megatron's.
    """
    from megatron.core import parallel_state as ps

    lay = Layout.current()
    tp_group = groups.tp if groups else ps.get_tensor_model_parallel_group()
    ep_group = groups.ep if groups else ps.get_expert_model_parallel_group()
    etp_group = groups.etp if groups else ps.get_expert_tensor_parallel_group()
    params = dict(model.named_parameters())
    n_local = arch.num_experts // lay.ep
    for pm in param_maps(arch, lay.ep_rank, lay.ep, model_impl(model)):
        if include is not None and not include(pm):
            continue
        local = param_tensor(params, pm).detach()
        if pm.split not in ("fc1", "fc2"):
            shards = ([local] if pm.split == "replicated" else
                      all_gather_tensors(to_group_device(local, tp_group), tp_group, lay.tp, name=pm.mcore))
            yield from shards_to_hf(pm, shards, arch).items()
            continue
        shards = all_gather_tensors(to_group_device(local, etp_group), etp_group, lay.etp, name=pm.mcore)
        full = shards_to_hf(pm, shards, arch)
        if not all_experts or lay.ep == 1:
            yield from full.items()
            continue
        for name, tensor in full.items():
            for r, t in enumerate(all_gather_tensors(to_group_device(tensor, ep_group), ep_group, lay.ep, name=name)):
                yield peer_expert_name(name, pm, lay, n_local, r), t
