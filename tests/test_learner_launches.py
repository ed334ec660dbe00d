"""What the learner costs in aten ops and host reads, counted on CPU (issues 37, 48, 52): the GPU budget of a learner
is held here by counting what a GPU would launch. A TorchDispatchMode sees every aten op a call runs; a host read
(``Count.syncs``) is an op that reads a device value on the host: ``_local_scalar_dense`` (``.item()``, ``bool()``,
``int()``), ``is_nonzero`` (``if tensor``), an op whose output size depends on the values (``nonzero``,
``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``), and, seen through a TorchFunctionMode
since they run below aten's dispatch, ``tolist()``, ``numpy()`` and ``cpu()`` (a copy to the host on a GPU). On an
H200 the learner was host-bound: 21,723 launches and 770 syncs per W4A16 log-prob forward of 2 layers, most of them
the quantizer's per expert weight, then Megatron's SequentialMLP: an MLP per expert, and a token permutation by
``masked_select`` with ``tolist()`` of the token counts in every layer.

The learner here is the default one (``model.experts`` auto: grouped on CPU, moe/grouped.py): a forward and a train
step cost the same at 8 and 32 experts, and read the host only for the loss and the grad norm.

Counted for each scheme against bf16 at 8 and 32 experts (2 layers, hidden 128): the ops fake quant adds to a
log-prob forward (which refreshes every weight the optimizer changed) and to a train step. Its weights are refreshed
by one quantizer call per layer and projection of the experts (``qat/modules.py``, ``_Stack``), so what it adds does
not grow with the experts; no host sync is added. W8A8 also quantizes each linear's input: Megatron's local spec
(SequentialMLP) calls each expert's linears on its own tokens, so those calls are per expert (TE's grouped MLP calls
its input quantizer once per layer); the test allows exactly that and nothing more."""

from __future__ import annotations

import collections
import dataclasses
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_qarl.moe.parallelize import init_parallel, run_ranks

SYNCS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.nonzero.default",
         "aten.item.default", "aten.masked_select.default", "aten._unique2.default", "aten.unique_dim.default",
         "aten.unique_consecutive.default"}
HOST_METHODS = {"tolist", "numpy", "cpu"}  # below aten's dispatch: a TorchFunctionMode sees them
SCHEMES = ("w4a16", "w8a8_fp8", "w8a8_int8")
LAYERS = 2


class _HostMethods(TorchFunctionMode):
    def __init__(self, reads: collections.Counter):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_METHODS:
            self.reads[f"Tensor.{name}"] += 1
        return func(*args, **(kwargs or {}))


class Count(TorchDispatchMode):
    """aten ops and host reads of the code run inside it (module docstring)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.reads = collections.Counter()
        self._methods = _HostMethods(self.reads)

    def __enter__(self):
        self._methods.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._methods.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops[name] += 1
        if name in SYNCS or (name.startswith("aten.repeat_interleave") and (kwargs or {}).get("output_size") is None):
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> int:
        return sum(self.reads.values())


def arch_with(experts: int, layers: int = LAYERS):
    from megatron_qarl.moe.model import Qwen3MoeArch

    return Qwen3MoeArch(vocab_size=256, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, num_experts=experts, num_experts_per_tok=2,
                        moe_intermediate_size=128, intermediate_size=256, rms_norm_eps=1e-6, rope_theta=1e6,
                        max_position_embeddings=256, norm_topk_prob=True, tie_word_embeddings=False,
                        attention_bias=False)


def _counts(scheme: str, experts: int, layers: int = LAYERS) -> dict:
    """(ops, host reads) of a log-prob forward right after a train step (so it refreshes every quantized weight) and
    of the next train step (its forward reuses them; its optimizer step changes them), after a warm-up step; the
    reads by name."""
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.qat.config import QuantConfig

    torch.manual_seed(0)  # the same weights, so the same experts get tokens
    learner = Learner(arch_with(experts, layers), ParallelConfig(), OptimConfig(lr=1e-5),
                      quant=QuantConfig(scheme=scheme))
    # right-padded rows, as before packing: its cu_seqlens are host tensors whose reads on a CPU look like device reads
    # here (Megatron's THD rope reads them); tests/test_packing.py counts them on the simulated device: none there
    learner.packs = False
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = Batch(tokens, torch.ones(2, 15))

    def loss(lp, b):
        return token_mean_nll(lp, b, b.loss_mask_BT.numel())

    learner.train_step(batch, loss)
    with torch.no_grad(), Count() as forward:
        learner.logprobs(tokens)
    with Count() as step:
        learner.train_step(batch, loss)
    return {"forward": (forward.total, forward.syncs), "step": (step.total, step.syncs),
            "reads": {"forward": dict(forward.reads), "step": dict(step.reads)}}


def _act_ops(scheme: str) -> int:
    """aten ops of one W8A8 input fake quant (what each expert linear's input quantizer runs)."""
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.fake_quant import fake_quant_act

    x = torch.randn(5, 128, dtype=torch.bfloat16, requires_grad=True)
    with Count() as c:
        fake_quant_act(x, QuantConfig(scheme=scheme))
    assert c.syncs == 0
    return c.total


def _all_counts() -> dict:
    init_parallel()
    return {(scheme, e): _counts(scheme, e) for scheme in ("bf16", *SCHEMES) for e in (8, 32)} | \
        {(scheme, 8, 2 * LAYERS): _counts(scheme, 8, 2 * LAYERS) for scheme in ("bf16", *SCHEMES)} | \
        {("act", s): _act_ops(s) for s in ("w8a8_fp8", "w8a8_int8")}


@pytest.fixture(scope="module")
def counts() -> dict:
    return run_ranks(1, _all_counts)[0]


def test_the_table_of_what_fake_quant_adds(counts):
    rows = ["scheme  experts  forward ops (+added)  syncs (+)  step ops (+added)  syncs (+)"]
    for scheme in ("bf16", *SCHEMES):
        for e in (8, 32):
            c, b = counts[(scheme, e)], counts[("bf16", e)]
            rows.append(f"{scheme:9} {e:3}  {c['forward'][0]:6} ({c['forward'][0] - b['forward'][0]:+5})  "
                        f"{c['forward'][1]:4} ({c['forward'][1] - b['forward'][1]:+3})  {c['step'][0]:6} "
                        f"({c['step'][0] - b['step'][0]:+5})  {c['step'][1]:4} ({c['step'][1] - b['step'][1]:+3})")
    print("\n" + "\n".join(rows))
    assert counts[("bf16", 8)]["forward"][1] == 0  # the bf16 log-prob forward itself syncs nowhere


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("phase", ["forward", "step"])
def test_fake_quant_adds_no_host_sync_and_no_op_per_expert_weight(counts, scheme, phase):
    added = {e: (counts[(scheme, e)][phase][0] - counts[("bf16", e)][phase][0],
                 counts[(scheme, e)][phase][1] - counts[("bf16", e)][phase][1]) for e in (8, 32)}
    assert added[8][1] == added[32][1] == 0, f"{scheme} {phase}: host syncs added {added}"
    growth = added[32][0] - added[8][0]
    # W8A8's input quantizers run once per projection over the layer's routed tokens (moe/grouped.py)
    assert abs(growth) <= 8, f"{scheme} {phase}: ops added {added} grow with the experts"


# what a train step still reads to the host, at any number of experts and layers: the global loss
# (``learner.rank.dp_sum``'s float) and the grad norm (Megatron's get_grad_norm_fp32: ``total_norm.item()``, which
# clipping and the finite check need). A log-prob forward reads nothing at EP 1 (moe/dispatch.py: the tokens are
# permuted by a sort, their counts per expert stay on the device as the grouped matmul's offsets).
STEP_SYNCS = 2


@pytest.mark.parametrize("scheme", ("bf16", *SCHEMES))
def test_a_forward_and_a_train_step_cost_the_same_at_8_and_32_experts(counts, scheme):
    """Issue 52: total aten ops, not only what fake quant adds. Before, Megatron's SequentialMLP ran an MLP per expert
    (bf16: 12 ops per expert and layer in a forward, W8A8 40 with an input quantizer per expert)."""
    for phase in ("forward", "step"):
        at8, at32 = counts[(scheme, 8)][phase][0], counts[(scheme, 32)][phase][0]
        assert abs(at32 - at8) <= 8, f"{scheme} {phase}: {at8} aten ops at 8 experts, {at32} at 32"


def test_host_reads_are_the_loss_and_the_grad_norm_whatever_the_experts_and_layers(counts):
    """Issues 48, 52: the total host reads of a forward and a train step, Megatron's included. Before issue 48,
    Megatron's fallback Adam and l2 norm read every parameter's step counter and gradient norm; before issue 52 its MoE
    token permutation read the host in every layer (two masked_select, the alltoall dispatcher's and SequentialMLP's
    tolist() of the token counts)."""
    rows = {(scheme, *size): (counts[(scheme, *size)]["forward"][1], counts[(scheme, *size)]["step"][1])
            for scheme in ("bf16", *SCHEMES) for size in ((8,), (32,), (8, 2 * LAYERS))}
    print("\nhost reads (forward, train step) at 8 / 32 experts x 2 layers and 8 x 4: "
          + ", ".join(f"{k}: {v}" for k, v in rows.items()))
    bad = {k: (v, counts[k]["reads"]) for k, v in rows.items() if v != (0, STEP_SYNCS)}
    assert not bad, bad


def random_model(arch, seed: int):
    """Megatron's model of ``arch`` with every weight drawn from N(0, 0.05) after ``seed`` (experts differ)."""
    from megatron_qarl.moe.model import build_model

    torch.manual_seed(seed)
    model = build_model(arch)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def _stack_vs_alone(scheme: str, group_size: int | None) -> dict:
    """Each stacked target's codes, scales, zero points and forward weight against the one quantizer run on its
    Hugging Face tensors one by one (the path before issue 37); which targets were stacked."""
    from megatron_qarl.gpu.smoke import same_bits
    from megatron_qarl.moe.convert import Layout, hf_to_shard, shards_to_hf
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.modules import apply_fake_quant
    from megatron_qarl.qat.quantizer import fake_quantize_weight

    init_parallel()
    arch = arch_with(8)
    cfg = QuantConfig(scheme=scheme, **({"group_size": group_size} if group_size else {}))
    fq = apply_fake_quant(random_model(arch, 3), arch, cfg)
    differ, stacked = [], 0
    for t in fq.targets:
        codes = fq.target_codes(t)
        stacked += t.stack is not None
        hf = shards_to_hf(t.pm, [t.param.detach()], arch)
        alone = {n: fake_quantize_weight(w, cfg, n) for n, w in hf.items()}
        for n, (qw, _) in alone.items():
            for field in ("codes", "scales", "zero_points"):
                if not same_bits(getattr(codes[n], field), getattr(qw, field)):
                    differ.append(f"{n}.{field}")
        local = hf_to_shard(t.pm, lambda n, alone=alone: alone[n][1], arch, Layout.current())
        if not torch.equal(local, t.local_fq):
            differ.append(f"{t.pm.mcore} forward weight")
    return {"differ": differ, "stacked": stacked, "stacks": len(fq.stacks), "targets": len(fq.targets),
            "names": sorted(s.name for s in fq.stacks)}


@pytest.mark.parametrize("scheme, group_size", [("w4a16", None), ("w4a16", 64), ("w8a8_fp8", None),
                                                ("w8a8_fp8", 96), ("w8a8_int8", None)])
def test_a_stack_refresh_gives_each_weight_the_bits_it_gets_alone(scheme, group_size):
    r = run_ranks(1, _stack_vs_alone, scheme, group_size)[0]
    assert r["differ"] == [], r["differ"][:10]
    if scheme == "w8a8_fp8" and group_size == 96:  # 128 rows are no whole number of 96-row blocks: alone
        assert r["stacks"] == 0 and r["stacked"] == 0
    else:  # one stack per layer and projection; the experts' 2 x 8 x 2 targets in them
        assert r["stacks"] == 2 * LAYERS and r["stacked"] == 2 * 8 * LAYERS, r
        assert "decoder.layers.0.mlp.experts.fc1 (8 experts)" in r["names"]


def _nonfinite(scheme: str) -> dict:
    from megatron_qarl.moe.model import build_model
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.modules import apply_fake_quant

    init_parallel()
    arch = arch_with(8)
    model = build_model(arch, experts="grouped")  # the learner's (SequentialMLP reads its token counts to the host)
    fq = apply_fake_quant(model, arch, QuantConfig(scheme=scheme))
    expert = next(t for t in fq.targets if t.stack is not None and t.index == 3)
    with torch.no_grad():
        expert.master[5, 7] = math.nan  # its own weight: a row of the layer's stacked parameter
    tokens = torch.randint(0, arch.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    from megatron_qarl.moe.model import forward_logits

    with torch.no_grad(), Count() as c:
        forward_logits(model, tokens)
    other = next(t for t in fq.targets if t.stack is not expert.stack)
    try:
        fq.target_codes(expert)
        refused = ""
    except ValueError as err:
        refused = str(err)
    return {"syncs": c.syncs, "local_finite": bool(torch.isfinite(expert.local_fq).all()), "refused": refused,
            "other_finite": bool(torch.isfinite(other.local_fq).all())}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_nonfinite_weight_costs_no_sync_in_the_forward_and_is_refused_by_the_sync_by_name(scheme):
    """Before issue 37 every refresh read each weight's finiteness on the host (one sync per weight). Now a nan
    makes its stack's scales and fake-quant weights non-finite (the step's gradients too, which Megatron's optimizer
    skips), and the weight sync, which asks for the codes, refuses it by name."""
    r = run_ranks(1, _nonfinite, scheme)[0]
    assert r["syncs"] == 0 and not r["local_finite"] and r["other_finite"]
    assert r["refused"].startswith("decoder.layers.") and "non-finite" in r["refused"], r["refused"]


def _after_failures() -> dict:
    import megatron.core.tensor_parallel.layers as megatron_layers

    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.qat import modules
    from megatron_qarl.qat.config import QuantConfig

    init_parallel()
    linear = megatron_layers.linear_with_grad_accumulation_and_async_allreduce
    out = {}
    bad = dataclasses.replace(arch_with(8), hidden_size=96, head_dim=24)  # K = 96: no W4A16 group of 128 fits
    try:
        Learner(bad, ParallelConfig(), OptimConfig(lr=1e-5), quant=QuantConfig(scheme="w4a16"))
    except ValueError as err:
        out["build"] = str(err)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    # SequentialMLP's experts are Megatron's linears, whose functional ModelOpt replaces during their forward
    failing = Learner(arch_with(8), ParallelConfig(), OptimConfig(lr=1e-5), quant=QuantConfig(scheme="w4a16"),
                      experts="sequential")
    quantizer = failing.fake_quant.targets[0].weight_quantizer

    def boom(_w):
        raise RuntimeError("a forward that fails inside a quantized linear")

    modules._BOUND[quantizer] = boom
    try:
        failing.logprobs(tokens)
    except RuntimeError as err:
        out["forward"] = str(err)
    out["restored"] = (megatron_layers.linear_with_grad_accumulation_and_async_allreduce is linear
                       and not hasattr(megatron_layers, "_linear_with_grad_accumulation_and_async_allreduce"))
    learner = Learner(arch_with(8), ParallelConfig(), OptimConfig(lr=1e-5), quant=QuantConfig(scheme="w4a16"))
    out["logprobs"] = bool(torch.isfinite(learner.logprobs(tokens)).all())
    out["loss"] = learner.train_step(Batch(tokens, torch.ones(2, 15)),
                                     lambda lp, b: token_mean_nll(lp, b, b.loss_mask_BT.numel()))["loss"]
    return out


def test_a_failed_build_or_forward_leaves_the_process_able_to_build_and_train():
    """Issue 37: a W4A16 learner on an arch whose K no group divides failed at its first forward, inside ModelOpt's
    replace_function, which restores Megatron's linear functional only on a normal exit: every later learner in the
    process then ran the failed module's linear. Now the build refuses it naming the key, and a forward that raises
    inside a quantized linear restores the functional (qat/modules.py ``_replace_function``)."""
    r = run_ranks(1, _after_failures)[0]
    assert r["build"].startswith("quant.group_size: 128 does not divide K=96 of model.layers.0."), r
    assert r["forward"] == "a forward that fails inside a quantized linear" and r["restored"], r
    assert r["logprobs"] and math.isfinite(r["loss"]), r
