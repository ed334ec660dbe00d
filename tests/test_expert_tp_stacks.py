"""Expert weights stacked at expert-TP > 1 (issue 48, item 4): at EP 1 and TP > 1 Megatron splits every expert's
linears over the expert-tensor-parallel group (ETP = TP; fc1's gate_proj and up_proj each along rows, fc2 along K).
Before, such a target refreshed alone (``qat/modules.py``: ``_stacks`` took only unsplit targets): one expert-TP
all_gather and one quantizer call per expert weight, about 12k all_gathers and 18k launches per optimizer step for
Qwen3-30B-A3B. Now one stack per layer and projection gathers the concatenation of its local shards once, lays the
rows out as the Hugging Face tensors (``shards_to_hf``) and quantizes them in one call.

Counted on gloo with two ranks at TP2/EP1 (ETP 2) and at TP2/EP2 (ETP 1, the control: stacked before too), with
the harness of tests/test_learner_launches.py (a TorchDispatchMode sees every aten op and every c10d collective):
the refresh after an optimizer-like step runs as many ops and all_gathers at 32 experts as at 8; every expert's
codes and scales (what the weight sync is handed: ``target_codes``, whole tensors on every rank), its forward weight,
the model's logits and each expert master's gradient equal bit for bit those of the lone path
(``modules.STACK_EXPERTS = False``, which is the old code at ETP > 1), for every scheme."""

from __future__ import annotations

import math

import pytest
import torch
from test_learner_launches import LAYERS, Count, arch_with

from megatron_qarl.moe.parallelize import init_parallel, run_ranks
from megatron_qarl.moe.verify import world_size

LAYOUTS = [(2, 1), (2, 2)]  # (tp, ep): expert-TP 2; expert-TP 1 (EP > 1), the control
COUNTED = ("w4a16", "w8a8_fp8", "w8a8_int8")
# (scheme, QuantConfig options, master dtype): every scheme; W4A16's groups along K and asymmetric zero points;
# FP8 blocks a TP shard's rows are not whole of (64 rows per rank, 128-row blocks), and blocks of 96, which no
# expert weight has whole rows of (128): those stay alone under both paths (and no forward: 96 does not divide the
# activations' K, 128)
CASES = [
    ("w4a16", {}, "float32"), ("w4a16", {}, "bfloat16"), ("w4a16", {"group_size": 64}, "float32"),
    ("w4a16", {"symmetric": False}, "float32"), ("w4a16", {"num_bits": 3}, "bfloat16"),
    ("w8a8_fp8", {}, "float32"), ("w8a8_fp8", {}, "bfloat16"), ("w8a8_fp8", {"group_size": 64}, "float32"),
    ("w8a8_fp8", {"group_size": 96}, "float32"),
    ("w8a8_int8", {}, "float32"), ("w8a8_int8", {}, "bfloat16"),
]
FIELDS = ("codes", "scales", "zero_points")


def _model(arch, tp: int, ep: int, dtype: str, seed: int = 3):
    """This rank's model with N(0, 0.05) weights: the same on every rank but the experts', which differ per rank
    (so that each expert-TP shard differs; the router and attention must agree over TP)."""
    from megatron_qarl.moe.model import build_model

    torch.manual_seed(seed)
    model = build_model(arch, tp=tp, ep=ep, dtype=getattr(torch, dtype))
    own = torch.Generator().manual_seed(seed * 1000 + torch.distributed.get_rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.copy_(torch.randn(p.shape, generator=own) * 0.05)
            else:
                p.normal_(0, 0.05)
    return model


def _fake_quant(arch, cfg, tp: int, ep: int, dtype: str, stacked: bool):
    from megatron_qarl.qat import modules

    model = _model(arch, tp, ep, dtype)
    modules.STACK_EXPERTS = stacked
    try:
        return model, modules.apply_fake_quant(model, arch, cfg)
    finally:
        modules.STACK_EXPERTS = True


def _refresh_counts(scheme: str, experts: int, tp: int, ep: int, stacked: bool) -> dict:
    """aten ops, c10d collectives and host syncs of refreshing every target after a step (each master changed in
    place, as the optimizer changes it), after a first refresh."""
    from megatron_qarl.qat.config import QuantConfig

    _, fq = _fake_quant(arch_with(experts), QuantConfig(scheme=scheme), tp, ep, "float32", stacked)
    for t in fq.targets:
        fq._refresh(t)
    with torch.no_grad():
        for t in fq.targets:
            t.param.mul_(1.0)  # a new version, the same values
    with Count() as c:
        for t in fq.targets:
            fq._refresh(t)
    collectives = sum(n for op, n in c.ops.items() if op.startswith("c10d."))
    return {"ops": c.total, "collectives": collectives, "syncs": c.syncs, "stacks": len(fq.stacks),
            "stacked": sum(t.stack is not None for t in fq.targets), "targets": len(fq.targets)}


def _seen(fq, model, arch) -> dict:
    """What the forward multiplies and the weight sync is handed, per target; the logits of one forward (where the
    scheme's activation groups divide the hidden size)."""
    from megatron_qarl.moe.model import forward_logits
    from megatron_qarl.qat.modules import finite_flags

    flags = [bool(f) for _, f in finite_flags(fq)]
    out = {}
    for t in fq.targets:
        codes = fq.target_codes(t, checked=True)
        with torch.no_grad():
            weight = t.weight_quantizer(t.param).detach().clone()
        out[t.pm.mcore] = (codes, weight, t.stack is not None)
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, grads = None, {}
    if fq.cfg.scheme != "w8a8_fp8" or arch.hidden_size % fq.cfg.group_size == 0:
        with torch.no_grad():
            logits = forward_logits(model, tokens)
        forward_logits(model, tokens).float().square().mean().backward()  # straight through to each master
        grads = {n: p.grad for n, p in model.named_parameters() if ".mlp.experts." in n}
    return {"targets": out, "logits": logits, "grads": grads, "flags": flags, "stacks": len(fq.stacks)}


def _differences(scheme: str, options: dict, dtype: str, tp: int, ep: int) -> dict:
    """Stacked against alone: every field that differs (by name), and how many targets were stacked."""
    from megatron_qarl.gpu.smoke import same_bits
    from megatron_qarl.qat.config import QuantConfig

    arch, cfg = arch_with(8), QuantConfig(scheme=scheme, **options)
    got = {stacked: _seen(*_fake_quant(arch, cfg, tp, ep, dtype, stacked)[::-1], arch) for stacked in (True, False)}
    stack, alone = got[True], got[False]
    differ = [] if same_bits(stack["logits"], alone["logits"]) else ["logits"]
    differ += [f"{n}.grad" for n, g in stack["grads"].items() if not same_bits(g, alone["grads"][n])]
    for mcore, (codes, weight, _) in stack["targets"].items():
        ref_codes, ref_weight, _ = alone["targets"][mcore]
        if sorted(codes) != sorted(ref_codes):
            differ.append(f"{mcore}: names {sorted(codes)}")
            continue
        for name, qw in codes.items():
            ref = ref_codes[name]
            differ += [f"{name}.{f}" for f in FIELDS if not same_bits(getattr(qw, f), getattr(ref, f))]
            differ += [f"{name}.{f}" for f in ("shape", "scheme", "group_size") if getattr(qw, f) != getattr(ref, f)]
        if not same_bits(weight, ref_weight):
            differ.append(f"{mcore} forward weight")
    return {"differ": differ, "stacks": stack["stacks"], "alone_stacks": alone["stacks"],
            "stacked": sum(s for _, _, s in stack["targets"].values()), "flags": stack["flags"],
            "grads": sum(g is not None for g in stack["grads"].values()),
            "hf_shapes": sorted({tuple(qw.shape) for c, _, _ in stack["targets"].values() for qw in c.values()})}


def _nonfinite(tp: int, ep: int) -> dict:
    """A nan in one expert's shard on rank 0 only: the stack's flag is false on every rank (the whole weight is
    quantized on each), the other stacks' true, and the sync's unchecked ask refuses it by the stack's name."""
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.modules import finite_flags

    _, fq = _fake_quant(arch_with(8), QuantConfig(scheme="w4a16"), tp, ep, "float32", True)
    expert = next(t for t in fq.targets if t.pm.split == "fc1" and t.pm.expert == 3)
    if torch.distributed.get_rank() == 0:
        with torch.no_grad():
            expert.param[5, 7] = math.nan
    flags = {name: bool(f) for name, f in finite_flags(fq)}
    try:
        fq.target_codes(expert)
        refused = ""
    except ValueError as err:
        refused = str(err)
    return {"flags": flags, "stack": expert.stack.name if expert.stack is not None else expert.pm.mcore,
            "refused": refused}


def _rank(tp: int, ep: int) -> dict:
    init_parallel(tp=tp, ep=ep)
    counts = {(scheme, e, stacked): _refresh_counts(scheme, e, tp, ep, stacked)
              for scheme in COUNTED for e in (8, 32) for stacked in (True, False)}
    bits = {(scheme, tuple(sorted(o.items())), dtype): _differences(scheme, o, dtype, tp, ep)
            for scheme, o, dtype in CASES}
    return {"counts": counts, "bits": bits, "nonfinite": _nonfinite(tp, ep)}


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda lay: f"tp{lay[0]}-ep{lay[1]}")
def layout(request) -> tuple[tuple[int, int], list[dict]]:
    tp, ep = request.param
    return request.param, run_ranks(world_size(tp, ep), _rank, tp, ep)


@pytest.mark.multiproc
def test_the_refresh_runs_the_same_ops_and_collectives_at_8_and_32_experts(layout):
    (tp, ep), results = layout
    rows = ["layout  scheme     experts  path     ops  all_gathers  syncs  stacks  stacked/targets"]
    for r in results[:1]:
        for (scheme, e, stacked), c in r["counts"].items():
            rows.append(f"tp{tp}ep{ep}  {scheme:9}  {e:7}  {'stacked' if stacked else 'alone':7}  {c['ops']:5}  "
                        f"{c['collectives']:11}  {c['syncs']:5}  {c['stacks']:6}  {c['stacked']}/{c['targets']}")
    print("\n" + "\n".join(rows))
    etp = tp if ep == 1 else 1
    for r in results:
        for scheme in COUNTED:
            small, big = r["counts"][(scheme, 8, True)], r["counts"][(scheme, 32, True)]
            assert small["syncs"] == big["syncs"] == 0, (scheme, small, big)
            assert small["stacks"] == big["stacks"] == 2 * LAYERS, (scheme, small, big)  # a layer's fc1, fc2
            assert big["stacked"] == big["targets"] - (small["targets"] - small["stacked"]), (scheme, small, big)
            assert (small["ops"], small["collectives"]) == (big["ops"], big["collectives"]), (scheme, small, big)
            # one all_gather per stack at expert-TP 2 (none at 1), and one per lone attention weight (W8A8; TP 2)
            lone = small["targets"] - small["stacked"]
            assert small["collectives"] == (2 * LAYERS if etp > 1 else 0) + lone, (scheme, small)
            old_small, old_big = r["counts"][(scheme, 8, False)], r["counts"][(scheme, 32, False)]
            if etp > 1:  # the lone path (the code before) gathers once per expert weight
                assert old_big["collectives"] - old_small["collectives"] == 2 * LAYERS * (32 - 8), (old_small,
                                                                                                    old_big)


@pytest.mark.multiproc
def test_every_expert_gets_the_codes_scales_and_forward_weight_it_gets_alone(layout):
    (tp, ep), results = layout
    for r in results:
        for (scheme, options, dtype), b in r["bits"].items():
            where = f"tp{tp}ep{ep} {scheme} {dict(options)} {dtype}"
            assert b["differ"] == [], f"{where}: {b['differ'][:10]}"
            assert b["alone_stacks"] == 0, where
            assert all(b["flags"]), where
            n_local = 8 // ep
            if dict(options).get("group_size") == 96:  # no expert weight is whole 96-row blocks: alone, both paths
                assert b["stacks"] == 0 and b["stacked"] == 0, where
            else:
                assert b["stacks"] == 2 * LAYERS and b["stacked"] == 2 * LAYERS * n_local, (where, b)
                assert b["grads"] > n_local, (where, b)  # the experts that got tokens: their masters' gradients
            # the sync is handed whole Hugging Face tensors on every rank: [128, 128] gate, up and down
            assert (128, 128) in b["hf_shapes"] and all(s[0] % 64 == 0 for s in b["hf_shapes"]), (where, b)


@pytest.mark.multiproc
def test_a_nan_in_one_shard_makes_its_stack_nonfinite_on_every_rank(layout):
    (tp, ep), results = layout
    etp = tp if ep == 1 else 1
    for rank, r in enumerate(results):
        n = r["nonfinite"]
        bad = [name for name, ok in n["flags"].items() if not ok]
        assert n["stack"].startswith("decoder.layers.0.mlp.experts.fc1 ("), n  # a stack's name
        if etp > 1 or rank == 0:  # gathered over expert-TP: every rank quantizes the nan; else rank 0's own
            assert bad == [n["stack"]], (rank, n)
            assert n["refused"].startswith(n["stack"]) and "non-finite" in n["refused"], n
        else:
            assert bad == [] and n["refused"] == "", (rank, n)
