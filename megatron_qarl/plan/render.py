"""The text of a plan (``plan.layouts``): the layout tables, a config's learner memory and step phases, the refusal of
a run that does not fit, and a simulation beside the plan (``qarl plan --simulate``)."""

from __future__ import annotations

from megatron_qarl.plan.layouts import LearnerSettings
from megatron_qarl.plan.memory import (
    GIB,
)


def _settings_text(st: LearnerSettings) -> str:
    """One line of the learner's memory settings."""
    offload = (f"optimizer CPU offload of {st.offload_fraction:.0%} of its shard" if st.offload_fraction
               else "no optimizer CPU offload")
    chunk = f" ({st.recompute_num_layers}-layer chunks)" if st.recompute == "full" else ""
    return (f"distributed optimizer {'on' if st.distributed_optimizer else 'off'}, {offload}, recompute "
            f"{st.recompute}{chunk}, attention {st.attention} ({st.attention_why})")


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    def fmt(v) -> str:
        return "yes" if v is True else "no" if v is False else str(v)

    cells = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return ["    " + line for line in lines]


_LEARNER_COLS = ["tp", "ep", "etp", "dp", "edp", "weights_gib", "gradients_gib", "optimizer_gib", "activations_gib",
                 "qat_cache_gib", "total_gib", "peak_phase", "peak_gib", "fixed_gib", "margin_gib", "fits"]
_ROLLOUT_COLS = ["tp", "ep", "moe_tp", "servers", "seqs_per_server", "weights_gib", "kv_pool_gib", "kv_needed_gib",
                 "kv_tokens", "seqs_at_full_length", "fits", "fits_all"]


def render_text(plan: dict, model: str) -> str:
    """The human-readable report of ``make_plan``'s dict."""
    p, c = plan["params"], plan["config"]
    w, cl, lo = c["workload"], c["cluster"], c["learner"]
    ckpt = ", ".join(f"{k} {v} GiB" for k, v in plan["rollout_checkpoint_gib"].items())
    out = [
        f"model {model}: {p['total'] / 1e9:.2f}B params ({p['active'] / 1e9:.2f}B active per token), scheme "
        f"{plan['scheme']}",
        f"rollout checkpoint: {ckpt}",
        f"GPU {cl['gpu_gib']:.2f} GiB (learner: its step's peak phase + the GPU's fixed costs; SGLang "
        f"mem_fraction_static "
        f"{cl['mem_fraction_static']}); {w['prompts_per_step']} prompts x {w['samples_per_prompt']} samples, "
        f"prompt {w['prompt_len']} + response {w['max_response_len']} tokens, micro-batch "
        f"{w['micro_batch_tokens'] or w['prompt_len'] + w['max_response_len']} tokens per DP rank",
        f"learner: {_settings_text(LearnerSettings(**{k: v for k, v in lo.items() if k != 'expert_imbalance'}))}",
    ]
    for cluster in plan["clusters"]:
        out.append(f"\n== {cluster['nodes']} x {cluster['gpus_per_node']} GPUs ==")
        for pl in cluster["placements"]:
            fit_l = [f"tp{r['tp']}/ep{r['ep']}" for r in pl["learner"] if r["fits"]]
            fit_r = [f"tp{r['tp']}/ep{r['ep']}" for r in pl["rollout"] if r["fits"]]
            out.append(f"\n{pl['placement']}: learner on {pl['learner_gpus']} GPUs, rollout on {pl['rollout_gpus']}"
                       f" GPUs -> {'FITS' if pl['fits'] else 'does not fit'}")
            out.append(f"  learner layouts that fit: {', '.join(fit_l) or 'none'}")
            out.append(f"  rollout layouts that fit: {', '.join(fit_r) or 'none'}")
            out.append("  learner (GiB per GPU):")
            out += _table(pl["learner"], _LEARNER_COLS)
            out.append("  rollout servers (per GPU):")
            out += _table(pl["rollout"], _ROLLOUT_COLS)
            out += [f"  rejected: {r}" for r in pl["rejected"]]
    return "\n".join(out)


def _micro_batch_text(le: dict) -> str:
    """The learner's micro-batch: what one forward/backward on a data-parallel rank holds."""
    share, seqs, tokens = le["sequences_per_dp_rank"], le["micro_batch_sequences"], le["micro_batch_tokens"]
    if seqs is None:
        return f"{tokens} tokens per forward/backward (--micro-batch-tokens)"
    n = -(-share // seqs)
    return (f"{seqs} sequence{'s' if seqs > 1 else ''} x {tokens // seqs} tokens = {tokens} tokens per "
            f"forward/backward (learner.micro_batch_size); a data-parallel rank's {share} sequences in {n} "
            f"micro-batch{'es' if n > 1 else ''}")


def learner_memory_line(le: dict, plan: dict) -> str:
    """The step's peak phase, its terms, the fixed costs and the margin on the GPU."""
    st = le["step"]
    terms = st["phases_gib"][st["peak_phase"]]
    parts = " + ".join(f"{k.replace('_', ' ')} {v}" for k, v in terms.items() if k != "total" and v)
    return (f"peak phase {st['peak_phase']}: {parts} = {st['peak_gib']} GiB, + fixed costs "
            f"{st['fixed_gib']['total']} GiB = {round(st['peak_gib'] + st['fixed_gib']['total'], 2)} GiB per GPU of "
            f"{plan['gpu_gib']}: margin {st['margin_gib']} GiB")


def step_lines(le: dict) -> list[str]:
    """Every phase's total, the peak, and the fixed costs item by item (``qarl plan --config``)."""
    st = le["step"]
    out = ["  phases (GiB per GPU): " + ", ".join(f"{p} {t['total']}" + (" <- peak" if p == st["peak_phase"] else "")
                                               for p, t in st["phases_gib"].items())]
    fixed = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in st["fixed_gib"].items() if k != "total")
    out.append(f"  fixed costs (GiB, plan/fixed_costs.py): {fixed}")
    return out


def render_config_text(plan: dict, config: str) -> str:
    p, le, ro, cl = plan["params"], plan["learner"], plan["rollout"], plan["cluster"]
    ckpt = ", ".join(f"{k} {v} GiB" for k, v in plan["rollout_checkpoint_gib"].items())
    gpus = f"{cl['nodes']} x {cl['gpus_per_node']} GPUs" if cl["gpus_per_node"] else "CPU nodes"
    st = LearnerSettings(**plan["learner_options"])
    out = [
        f"config {config}: {p['total'] / 1e9:.2f}B params, scheme {plan['scheme']}, {gpus}; per GPU of "
        f"{plan['gpu_gib']} GiB",
        f"rollout checkpoint: {ckpt}",
        f"\nlearner: {le['gpus']} ranks, tp{le['tp']} (sequence parallel {'on' if le['sp'] else 'off'}) ep{le['ep']} "
        f"etp{le['etp']}, dense DP {le['dp']}, expert DP {le['edp']}",
        f"  settings: {_settings_text(st)}",
        f"  micro-batch: {_micro_batch_text(le)}",
        f"  activation memory (train step): {le['activations_gib']} GiB per GPU",
        *step_lines(le),
        f"  {learner_memory_line(le, plan)} -> {'FITS' if le['fits'] else 'DOES NOT FIT'}",
    ]
    if st.offload_fraction:
        per_node = le["optimizer_host_gib_per_rank"] * min(le["gpus"], cl["gpus_per_node"] or 1)
        out.append(f"  host memory of the offloaded optimizer: {le['optimizer_host_gib_per_rank']} GiB per rank, "
                   f"{per_node:.2f} GiB per learner node")
    out += [
        f"\nrollout: {ro['servers']} servers x {ro['gpus_per_server']} GPU (SGLang --tp-size {ro['tp']}), "
        f"{ro['seqs_per_server']} sequences of up to {plan['workload']['seq_len']} tokens each",
        f"  weights {ro['weights_gib']} GiB, KV pool {ro['kv_pool_gib']} GiB ({ro['kv_tokens']} tokens "
        f"{'in bf16' if ro['kv_cache_dtype'] == 'auto' else 'in ' + ro['kv_cache_dtype']}, "
        f"{ro['seqs_at_full_length']} full-length sequences; all {ro['seqs_per_server']} need "
        f"{ro['kv_needed_gib']} GiB), overhead {ro['overhead_gib']} GiB -> "
        f"{'FITS' if ro['fits'] else 'DOES NOT FIT'}"
        f"{'' if ro['fits_all'] or not ro['fits'] else ' (some requests queue)'}",
        f"\n=> {'FITS' if plan['fits'] else 'DOES NOT FIT'} on {plan['gpu_gib']} GiB GPUs",
        f"\nweight sync: {plan['sync']['payload_gib']} GiB per sync ({plan['sync']['low_bit_gib']} GiB low-bit), "
        "seconds (plan/sync.py):",
    ]
    for row in plan["sync"]["rows"]:
        deltas = ", ".join(f"{k.removeprefix('delta ').removesuffix('_s')} {v}" for k, v in row.items()
                           if k.startswith("delta "))
        out.append(f"  {row['layout']} over {row['link']}: full {row['full_s']} s (EP gather {row['gather_s']} s); "
                   f"delta: {deltas} s")
    if "alternatives" in plan:
        out.append(f"\nlayouts of {cl['nodes']} x {cl['gpus_per_node'] or 8} GPUs that fit with these settings "
                   "(qarl plan --model for the tables):")
        for alt in plan["alternatives"]:
            out.append(f"  {alt['placement']}: learner on {alt['learner_gpus']}, rollout on {alt['rollout_gpus']} -> "
                       f"{'FITS' if alt['fits'] else 'does not fit'}; learner "
                       f"{', '.join(alt['learner_fit']) or 'none'}; rollout {', '.join(alt['rollout_fit']) or 'none'}")
    return "\n".join(out)


def refusal(plan: dict, config: str) -> str | None:
    """Why ``qarl train`` must not start a GPU run whose ``config_plan`` does not fit, with the plan's figures
    (None when it fits)."""
    if plan["fits"]:
        return None
    le, ro = plan["learner"], plan["rollout"]
    why = []
    if not le["fits"]:
        why.append(f"the learner (tp{le['tp']}/ep{le['ep']} on {le['gpus']} GPUs) needs {learner_memory_line(le, plan)}"
                   f"; micro-batch: {_micro_batch_text(le)}; "
                   f"{_settings_text(LearnerSettings(**plan['learner_options']))}")
    if not ro["fits"]:
        why.append(f"a rollout server (SGLang --tp-size {ro['tp']}) holds {ro['weights_gib']} GiB of weights per GPU, "
                   f"leaving a KV pool of {ro['kv_pool_gib']} GiB: not one full-length sequence "
                   f"({plan['workload']['seq_len']} tokens)")
    attention = plan["learner_options"]["attention"]
    return (f"{config}: does not fit {plan['gpu_gib']} GiB GPUs (qarl plan --config {config} --attention {attention}"
            f"): " + "; and ".join(why)
            + ". Lower learner.micro_batch_size, set learner.recompute, learner.optimizer_cpu_offload, or use more "
              "learner GPUs (launch.memory_check=false starts it anyway)")


def render_simulation_text(check: dict) -> str:
    sim = check["simulation"]
    runs = ", ".join(f"{s['layers']} layers {s['seconds']} s" for s in sim["simulated"])
    out = [f"\nsimulated learner rank (rank 0 of tp{check['layout']['tp']}/ep{check['layout']['ep']} on "
           f"{check['layout']['gpus']} GPUs, local spec: {sim['simulated'][0]['modules']}; shape-only device; "
           f"{runs}; phases linear in the layers extrapolated to {sim['model_layers']}, the sync's at the simulated "
           "counts):",
           f"  {'phase':<16} {'layers':>6} {'term':<11} {'plan GiB':>9} {'sim GiB':>9} {'plan-sim':>9}"]
    for r in check["rows"]:
        diff = "n/a" if r["diff"] is None else f"{r['diff']:+.1%}"
        out.append(f"  {r['phase']:<16} {r['layers']:>6} {r['term']:<11} {r['plan'] / GIB:>9.2f} "
                   f"{r['simulated'] / GIB:>9.2f} {diff:>9}")
    for key, what in (("largest", "the phases but the sync"), ("largest_sync", "the sync (a bound)")):
        worst = check[key]
        if worst:
            out.append(f"  largest relative error of a non-trivial term, {what}: {worst['diff']:+.1%} "
                       f"({worst['phase']}, {worst['term']}, {worst['layers']} layers)")
    sync = sim["extrapolated"]["sync"]
    if sync:
        out.append(f"  sync payload at {sim['model_layers']} layers: {sync['bytes'] / GIB:.2f} GiB in "
                   f"{sync['tensors']} tensors ({sync['low_bit'] / GIB:.2f} GiB low-bit)")
    return "\n".join(out)

