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
  Column/RowParallelLinear (same ``weight`` name and TP sharding) stand in for, with TE's GEMM;
- ``rmsnorm.py`` RMSNorm: ``weight`` -- TENorm with normalization="RMSNorm";
- ``grouped_linear.py`` GroupedLinear: ``weight0`` .. ``weight{n-1}`` [out, in] per GEMM, after dividing the
  parallel dimension by the expert-TP size -- Megatron's TEColumnParallelGroupedLinear / TERowParallelGroupedLinear;
- ``attention`` DotProductAttention: no parameters -- Megatron's local DotProductAttention stands in.

``install(monkeypatch)`` puts them where Megatron's TE spec provider and its transformer block look them up, and
makes ``get_gpt_layer_with_transformer_engine_spec`` callable without TE (megatron-core 0.16.1 only binds
``TESpecProvider`` in gpt_layer_specs when ``import transformer_engine`` succeeds).

The TE package itself, for ModelOpt's TE plugin (``install_te_package()``, in a fresh process before ModelOpt is
imported: modelopt/torch/quantization/plugins/__init__.py imports its ``transformer_engine`` plugin once, when
``modelopt.torch.quantization`` is first imported, inside ``import_plugin``, which skips it if TE does not import).
The plugin (ModelOpt 0.47) registers against ``te.pytorch.Linear``, ``LayerNormLinear`` and
``module.grouped_linear.GroupedLinear``, and its Megatron plugin registers Megatron's TE wrappers from
``megatron.core.extensions.transformer_engine`` (here: the stand-ins above). At forward time it patches TE's
autograd functionals and calls ``_assert_te_fp8_enabled``, which reads ``FP8GlobalStateManager.is_fp8_enabled()``
from ``transformer_engine.pytorch.fp8``. So the stand-ins derive from the TE classes below and compute through
TE-shaped functionals that ModelOpt finds by name and signature (TE 2.x, ``transformer_engine/pytorch/module/``):

- ``linear.py`` ``_Linear.forward(ctx, weight, inp, bias, non_tensor_args)``;
- ``layernorm_linear.py`` ``_LayerNormLinear.forward(ctx, inp, ln_weight, ln_bias, weight, bias, non_tensor_args)``,
  whose GEMMs go through the module-level ``general_gemm(A, B, layout)`` (TN: B @ A^T; NN: B @ A; NT: B^T @ A), the
  forward GEMM first, then in the backward dgrad before wgrad (ModelOpt patches it in that order);
- ``grouped_linear.py`` ``_GroupedLinear.forward(ctx, inp, m_splits, non_tensor_args, *weights_and_biases)``;
- ``fp8.py`` ``FP8GlobalStateManager`` and ``fp8_autocast`` (the process-wide autocast state, saved on entry and
  restored on exit as TE does), and ``common/recipe`` ``Float8BlockScaling``.

The GEMMs compute in the operands' dtype, with or without fp8 autocast (no FP8 numerics are emulated);
``recording()`` logs every forward GEMM's operands (the module, its weight and input as the GEMM receives them,
and whether fp8 autocast was on). ``get_fp8_context`` is what megatron-core 0.16.1's fp8_utils binds where TE
imports (an ``fp8_autocast`` with the config's recipe for every layer when ``config.fp8``), bound by ``install``
where the transformer block looks it up.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch

from megatron_qarl.moe.megatron_cpu import RMSNorm

TE_VERSION = "2.8.0"  # a TE 2.x: ModelOpt takes its general_gemm path (>= 2.0), Megatron its blockwise recipe


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


# ---------------------------------------------------------------------------------------- TE's package
class FP8GlobalStateManager:
    """transformer_engine/pytorch/fp8.py: the process-wide fp8 autocast state."""

    FP8_ENABLED = False
    FP8_RECIPE = None

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED

    @classmethod
    def get_fp8_recipe(cls):
        return cls.FP8_RECIPE


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None,
                 _graph: bool = False):
    """TE's fp8_autocast: FP8 on (or off) inside, the previous state restored on exit."""
    saved = FP8GlobalStateManager.FP8_ENABLED, FP8GlobalStateManager.FP8_RECIPE
    FP8GlobalStateManager.FP8_ENABLED = bool(enabled)
    FP8GlobalStateManager.FP8_RECIPE = (fp8_recipe or Float8BlockScaling()) if enabled else None
    try:
        yield
    finally:
        FP8GlobalStateManager.FP8_ENABLED, FP8GlobalStateManager.FP8_RECIPE = saved


class Format:
    """transformer_engine/common/recipe: the FP8 formats."""

    E4M3 = "E4M3"
    HYBRID = "HYBRID"


class Float8BlockScaling:
    """transformer_engine/common/recipe: the blockwise recipe (1 x 128 activations, 128 x 128 weights)."""

    def __init__(self, fp8_format=Format.E4M3, **_kwargs):
        self.fp8_format = fp8_format


_RECORD: list | None = None  # forward GEMM operands while ``recording()`` is active
_CURRENT: list = []  # the TE module whose forward is running


@contextlib.contextmanager
def recording():
    """Log every forward GEMM: dicts with ``module`` (the TE module object), ``weight`` and ``input`` (the operands
    as the GEMM receives them, detached copies) and ``fp8`` (whether fp8 autocast was on)."""
    global _RECORD
    _RECORD = log = []
    try:
        yield log
    finally:
        _RECORD = None


@contextlib.contextmanager
def _running(module):
    _CURRENT.append(module)
    try:
        yield
    finally:
        _CURRENT.pop()


def _module(name: str) -> types.ModuleType:
    """A module of the TE package (``install_te_package`` puts the same objects in sys.modules): ModelOpt patches
    their attributes, so the stand-ins look TE's functionals up there at call time, as TE's own modules do."""
    return _te_modules()[f"transformer_engine.pytorch.module.{name}"]


def general_gemm(A: torch.Tensor, B: torch.Tensor, *_args, layout: str = "TN", **_kwargs):
    """TE's general_gemm: TN -> B @ A^T (forward), NN -> B @ A (dgrad), NT -> B^T @ A (wgrad); returns a tuple
    whose first item is the product, as TE 2.x does."""
    if layout == "TN":
        if _RECORD is not None:
            _RECORD.append({"module": _CURRENT[-1] if _CURRENT else None, "weight": A.detach().clone(),
                            "input": B.detach().clone(), "fp8": FP8GlobalStateManager.FP8_ENABLED})
        out = B @ A.t()
    elif layout == "NN":
        out = B @ A
    elif layout == "NT":
        out = B.t() @ A
    else:
        raise ValueError(f"layout {layout!r}")
    return out, None, None, None


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class _Linear(torch.autograd.Function):
    """linear.py: y = inp @ weight^T (and its gradients)."""

    @staticmethod
    def forward(ctx, weight, inp, bias, non_tensor_args):  # noqa: ARG004 - TE's signature
        out = general_gemm(weight, _flat(inp))[0]
        if ctx is not None:
            ctx.save_for_backward(weight, inp)
        return out.reshape(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        weight, inp = ctx.saved_tensors
        g = _flat(grad)
        d_inp = general_gemm(weight, g, layout="NN")[0].reshape(inp.shape)
        d_weight = general_gemm(_flat(inp), g, layout="NT")[0]
        return d_weight, d_inp, None, None


class _LayerNormLinear(torch.autograd.Function):
    """layernorm_linear.py: RMSNorm(inp) (all-gathered over TP with sequence parallel) @ weight^T."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, bias, non_tensor_args):  # noqa: ARG004
        eps, group = non_tensor_args
        ln_out = _rms_norm(inp, ln_weight, eps)
        total = ln_out if group is None else _gather(ln_out, group)
        out = _module("layernorm_linear").general_gemm(weight, _flat(total))[0].reshape(*total.shape[:-1],
                                                                                    weight.shape[0])
        if ctx is not None:
            ctx.save_for_backward(inp, ln_weight, weight, total)
            ctx.eps, ctx.group = eps, group
        return out

    @staticmethod
    def backward(ctx, grad):
        inp, ln_weight, weight, total = ctx.saved_tensors
        g = _flat(grad)
        gemm = _module("layernorm_linear").general_gemm
        d_total = gemm(weight, g, layout="NN")[0].reshape(total.shape)  # dgrad first, then wgrad
        d_weight = gemm(_flat(total), g, layout="NT")[0]
        d_ln_out = d_total if ctx.group is None else _reduce_scatter(d_total, ctx.group)
        with torch.enable_grad():
            x, w = inp.detach().requires_grad_(), ln_weight.detach().requires_grad_()
            d_inp, d_ln_weight = torch.autograd.grad(_rms_norm(x, w, ctx.eps), (x, w), d_ln_out)
        return d_inp, d_ln_weight, None, d_weight, None, None


class _GroupedLinear(torch.autograd.Function):
    """grouped_linear.py: the rows of expert i times weight_i^T."""

    @staticmethod
    def forward(ctx, inp, m_splits, non_tensor_args, *weights_and_biases):  # noqa: ARG004
        n = len(m_splits)
        weights = weights_and_biases[:n]
        parts = torch.split(inp, list(m_splits))
        out = [general_gemm(w, p)[0] for w, p in zip(weights, parts, strict=True)]
        if ctx is not None:
            ctx.save_for_backward(inp, *weights)
            ctx.m_splits = list(m_splits)
        return torch.cat(out) if out else inp.new_zeros(0, 0)

    @staticmethod
    def backward(ctx, grad):
        inp, *weights = ctx.saved_tensors
        parts, grads = torch.split(inp, ctx.m_splits), torch.split(grad, ctx.m_splits)
        d_inp = torch.cat([general_gemm(w, g, layout="NN")[0] for w, g in zip(weights, grads, strict=True)])
        d_weights = [general_gemm(p, g, layout="NT")[0] for p, g in zip(parts, grads, strict=True)]
        return (d_inp, None, None, *d_weights, *([None] * len(weights)))


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

    return _gather_along_first_dim(x, group)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import _reduce_scatter_along_first_dim

    return _reduce_scatter_along_first_dim(x, group)


def _apply(fn, *args):
    """TE modules call ``fn.apply(*args)`` with autograd on, ``fn.forward(None, *args)`` without (ModelOpt patches
    the one TE calls)."""
    return fn.apply(*args) if torch.is_grad_enabled() else fn.forward(None, *args)


class Linear(torch.nn.Module):
    """te.pytorch.Linear (module/linear.py): its forward runs ``_Linear``."""


class LayerNormLinear(torch.nn.Module):
    """te.pytorch.LayerNormLinear (module/layernorm_linear.py): its forward runs ``_LayerNormLinear``."""


class GroupedLinear(torch.nn.Module):
    """te.pytorch.GroupedLinear (module/grouped_linear.py): its forward runs ``_GroupedLinear``."""


@functools.cache
def _te_modules() -> dict[str, types.ModuleType]:
    def module(name: str, **attrs) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    linear = module("transformer_engine.pytorch.module.linear", _Linear=_Linear, Linear=Linear,
                    general_gemm=general_gemm)
    layernorm_linear = module("transformer_engine.pytorch.module.layernorm_linear", _LayerNormLinear=_LayerNormLinear,
                              LayerNormLinear=LayerNormLinear, general_gemm=general_gemm)
    grouped_linear = module("transformer_engine.pytorch.module.grouped_linear", _GroupedLinear=_GroupedLinear,
                            GroupedLinear=GroupedLinear, general_gemm=general_gemm)
    mod = module("transformer_engine.pytorch.module", linear=linear, layernorm_linear=layernorm_linear,
                 grouped_linear=grouped_linear)
    fp8 = module("transformer_engine.pytorch.fp8", FP8GlobalStateManager=FP8GlobalStateManager,
                 fp8_autocast=fp8_autocast)
    pytorch = module("transformer_engine.pytorch", Linear=Linear, LayerNormLinear=LayerNormLinear,
                     GroupedLinear=GroupedLinear, fp8_autocast=fp8_autocast, fp8=fp8, module=mod)
    recipe = module("transformer_engine.common.recipe", Float8BlockScaling=Float8BlockScaling, Format=Format)
    common = module("transformer_engine.common", recipe=recipe)
    te = module("transformer_engine", __version__=TE_VERSION, pytorch=pytorch, common=common)
    return {m.__name__: m for m in (te, pytorch, mod, linear, layernorm_linear, grouped_linear, fp8, common, recipe)}


def install_te_package() -> None:
    """Make ``import transformer_engine`` (and the submodules above) give the stand-ins, for the rest of this
    process. Only in a fresh child process, before ``modelopt.torch.quantization`` is imported; never in the test
    session (other tests rely on TE being absent)."""
    if "modelopt.torch.quantization" in sys.modules:
        raise RuntimeError("install_te_package: ModelOpt's quantization plugins are imported already (without TE)")
    sys.modules.update(_te_modules())


# the modules to import before TE's stand-in package: what they bind where TE is absent (the stand-ins then replace
# their TE classes, ``install``)
MEGATRON_FIRST = ("megatron.core.extensions.transformer_engine",
                  "megatron.core.extensions.transformer_engine_spec_provider", "megatron.core.models.gpt",
                  "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.fp8_utils",
                  "megatron.core.transformer.transformer_block", "megatron.core.tensor_parallel.inference_layers",
                  "megatron.core.distributed", "megatron.core.optimizer", "megatron_qarl.learner.rank",
                  "megatron_qarl.moe.megatron_cpu")


def install_in_fresh_process():
    """In a fresh child process: Megatron first, without TE, then TE's stand-in package, then the stand-ins bound
    where Megatron looks them up (``install``), and the TE spec without Megatron's CUDA fusions (their kernels come
    with TE or apex; they change no GEMM operand). Returns the MonkeyPatch that undoes the bindings."""
    import importlib

    import pytest

    for name in MEGATRON_FIRST:
        importlib.import_module(name)
    install_te_package()
    mp = pytest.MonkeyPatch()
    install(mp)
    from megatron_qarl.moe import te as moe_te

    mp.setattr(moe_te, "CUDA_FUSIONS", {"moe_grouped_gemm": True})  # the TE spec's grouped experts; no CUDA kernels
    return mp


FP8_ALIGN = 16  # TE's Fp8Padding alignment (module/fp8_padding.py: 16 rows for the FP8 recipes but MXFP8)


class Fp8PaddingStandIn(torch.nn.Module):
    """TE's Fp8Padding(num_gemms)(inp, m_splits): each expert's rows zero-padded to a multiple of FP8_ALIGN;
    returns (padded, padded_splits)."""

    def __init__(self, num_gemms: int):
        super().__init__()
        self.num_gemms = num_gemms

    def forward(self, inp: torch.Tensor, m_splits: list[int]):
        padded = [-(-m // FP8_ALIGN) * FP8_ALIGN for m in m_splits]
        parts = torch.split(inp, list(m_splits))
        out = [torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, p - m)) for x, m, p in
               zip(parts, m_splits, padded, strict=True)]
        return torch.cat(out), padded


class Fp8UnpaddingStandIn(torch.nn.Module):
    """TE's Fp8Unpadding(num_gemms)(inp, m_splits): drops the rows Fp8Padding added."""

    def __init__(self, num_gemms: int):
        super().__init__()
        self.num_gemms = num_gemms

    def forward(self, inp: torch.Tensor, m_splits: list[int]):
        padded = [-(-m // FP8_ALIGN) * FP8_ALIGN for m in m_splits]
        return torch.cat([x[:m] for x, m in zip(torch.split(inp, padded), m_splits, strict=True)])


def get_fp8_context(config, layer_no: int = -1, is_init: bool = False):
    """megatron-core 0.16.1 fp8_utils.get_fp8_context where TE imports: ``fp8_autocast(enabled=True,
    fp8_recipe=<the config's recipe>)`` when ``config.fp8`` (its fp8_param at init) and the layer is not a BF16
    first/last layer, else a null context."""
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    need = config.fp8 if not is_init else config.fp8_param
    if not need or is_first_last_bf16_layer(config, layer_no):
        return contextlib.nullcontext()
    if config.fp8_recipe != "blockwise":
        raise NotImplementedError(f"the stand-in knows TE's blockwise recipe only, not {config.fp8_recipe!r}")
    return fp8_autocast(enabled=True, fp8_recipe=Float8BlockScaling(fp8_format=Format.E4M3))


class TENormStandIn(RMSNorm):
    """TENorm(config, hidden_size, eps) with config.normalization == "RMSNorm": TE's RMSNorm, parameter ``weight``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        if config.normalization != "RMSNorm":
            raise ValueError("the stand-in covers RMSNorm only (Qwen3-MoE)")
        super().__init__(config, hidden_size, eps)


def _column_parallel_linear():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return ColumnParallelLinear


class TELayerNormColumnParallelLinearStandIn(LayerNormLinear):
    """TE LayerNormLinear as Megatron wraps it: RMSNorm over the input (``layer_norm_weight``), then a column-parallel
    linear (``weight``, [output_size / TP, input_size]) through TE's ``_LayerNormLinear`` (the normed input
    all-gathered over TP with sequence parallel, as TE does). Same constructor arguments as Megatron's
    TELayerNormColumnParallelLinear; forward returns (output, None) like it."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool, bias: bool,
                 skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group=None, stride: int = 1):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError("the stand-in covers RMSNorm only (Qwen3-MoE)")
        if bias or gather_output:
            raise ValueError("the stand-in covers bias=False, gather_output=False only (Qwen3-MoE)")
        from megatron.core import parallel_state as ps

        linear = _column_parallel_linear()(input_size, output_size, config=config, init_method=init_method,
                                           bias=bias, gather_output=gather_output, skip_bias_add=skip_bias_add,
                                           is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name,
                                           tp_group=tp_group, stride=stride)
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.layer_norm_weight.sequence_parallel = config.sequence_parallel
        # TE holds the linear's weight on this module itself: take Megatron's (initialised, TP-tagged) parameter
        self.weight = linear.weight
        group = tp_group or ps.get_tensor_model_parallel_group()
        if group.size() > 1 and not config.sequence_parallel:
            raise ValueError("the stand-in covers TP > 1 with sequence parallel only (Megatron MoE requires it)")
        self._gather_group = group if group.size() > 1 else None

    def forward(self, x: torch.Tensor):
        with _running(self):
            out = _apply(_module("layernorm_linear")._LayerNormLinear, x, self.layer_norm_weight, None, self.weight,
                         None, (self.eps, self._gather_group))
        return out, None


@functools.cache
def _te_parallel_linear_standin(kind: str):
    """TE Linear as Megatron's TE{Column,Row}ParallelLinear wraps it: Megatron's {Column,Row}ParallelLinear (same
    ``weight``, TP split, communication and checkpoint sharding) whose GEMM is TE's ``_Linear``."""
    from megatron.core.tensor_parallel import layers

    base = layers.ColumnParallelLinear if kind == "column" else layers.RowParallelLinear

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self._forward_impl = _te_linear

    def forward(self, input_, *args, **kwargs):
        with _running(self):
            return base.forward(self, input_, *args, **kwargs)

    name = f"TE{kind.capitalize()}ParallelLinearStandIn"
    return type(name, (base, Linear), {"__init__": __init__, "forward": forward,
                                       "__doc__": _te_parallel_linear_standin.__doc__})


def _te_linear(input, weight, bias, **_kwargs):  # noqa: A002 - Megatron's keyword
    return _apply(_module("linear")._Linear, weight, input, bias, ())


class _GroupedLinearStandIn(GroupedLinear):
    """TE GroupedLinear as Megatron wraps it for experts: ``weight<i>`` [out, in] per local expert (the parallel
    dimension already divided by the expert-TP size); forward(x, m_splits) multiplies each expert's rows by its
    weight through TE's ``_GroupedLinear`` and returns (output, None)."""

    parallel_mode = ""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str | None = None,
                 pg_collection=None):
        super().__init__()
        if bias:
            raise ValueError("the stand-in covers bias=False only (Qwen3-MoE)")
        from megatron.core import parallel_state as ps

        self._ep_group = pg_collection.ep if pg_collection is not None else ps.get_expert_model_parallel_group()
        self._etp_group = pg_collection.expt_tp if pg_collection is not None else \
            ps.get_expert_tensor_parallel_group()
        self._edp_group = pg_collection.expt_dp if pg_collection is not None else \
            ps.get_expert_data_parallel_group()
        etp = self._etp_group.size()
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
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        with _running(self):
            out = _apply(_module("grouped_linear")._GroupedLinear, x, list(m_splits), (), *weights,
                         *([None] * self.num_gemms))
        return out, None


    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's TE{Column,Row}ParallelGroupedLinear checkpoint sharding (``_sharded_state_dict_grouped``,
        megatron/core/extensions/transformer_engine.py), without TE's FP8 ``_extra_state``: ``weight<i>`` is global
        expert ``ep_rank * num_gemms + i`` (an extra leading axis, or with ``singleton_local_shards`` a
        ``<expert>.`` key prefix), split over expert-TP along the parallel dimension, replicated over expert-DP."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        from megatron.core.utils import get_pg_rank, get_pg_size

        singleton = (metadata or {}).get("singleton_local_shards", False)
        axis = 0 if self.parallel_mode == "column" else 1
        num_global = get_pg_size(self._ep_group) * self.num_gemms
        offset = get_pg_rank(self._ep_group) * self.num_gemms
        out = {}
        for i in range(self.num_gemms):
            expert = offset + i
            offsets = sharded_offsets if singleton else (*sharded_offsets, (len(sharded_offsets), expert, num_global))
            sub = make_sharded_tensors_for_checkpoint({f"{i}.weight": getattr(self, f"weight{i}")}, "",
                                                      {f"{i}.weight": axis}, offsets, tp_group=self._etp_group,
                                                      dp_cp_group=(metadata or {}).get("dp_cp_group"))
            replace_prefix_for_sharding(sub, f"{i}.", f"{expert}.{prefix}" if singleton else prefix)
            tensor = sub[f"{i}.weight"]
            tensor.replica_id = (*tensor.replica_id[:2], get_pg_rank(self._edp_group))
            out[f"{prefix}weight{i}"] = tensor
        return out


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
    """Bind the stand-ins where megatron-core 0.16.1 looks the TE classes up (pytest's ``monkeypatch`` undoes it):
    its TE spec provider, the transformer block (final norm, fp8 context) and ``megatron.core.extensions.
    transformer_engine``, where ModelOpt's Megatron plugin imports them from."""
    import megatron.core.extensions.transformer_engine as extensions
    import megatron.core.extensions.transformer_engine_spec_provider as provider
    import megatron.core.models.gpt.gpt_layer_specs as gpt_layer_specs
    import megatron.core.transformer.moe.experts as experts
    import megatron.core.transformer.transformer_block as transformer_block

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(provider, "is_te_min_version", lambda *_a, **_k: True)  # a current TE (>= 2.4)
    for name, cls in {"TENorm": TENormStandIn,
                      "TELayerNormColumnParallelLinear": TELayerNormColumnParallelLinearStandIn,
                      "TEColumnParallelLinear": _te_parallel_linear_standin("column"),
                      "TERowParallelLinear": _te_parallel_linear_standin("row"),
                      "TEDotProductAttention": _dot_product_attention_standin(),
                      "TEColumnParallelGroupedLinear": TEColumnParallelGroupedLinearStandIn,
                      "TERowParallelGroupedLinear": TERowParallelGroupedLinearStandIn}.items():
        monkeypatch.setattr(provider, name, cls)
        monkeypatch.setattr(extensions, name, cls)
    # TELinear: the base ModelOpt registers too (no Qwen3-MoE module uses it)
    monkeypatch.setattr(extensions, "TELinear", type("TELinearStandIn", (Linear,), {}))
    # the block's final norm: TENorm where TE imports (transformer_block.LayerNormImpl)
    monkeypatch.setattr(transformer_block, "LayerNormImpl", TENormStandIn)
    monkeypatch.setattr(transformer_block, "get_fp8_context", get_fp8_context)
    # TEGroupedMLP under config.fp8: TE's per-expert padding (megatron/core/transformer/moe/experts.py)
    monkeypatch.setattr(experts, "HAVE_TE", True)
    monkeypatch.setattr(experts, "Fp8Padding", Fp8PaddingStandIn, raising=False)
    monkeypatch.setattr(experts, "Fp8Unpadding", Fp8UnpaddingStandIn, raising=False)
