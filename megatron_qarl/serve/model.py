"""Qwen3-MoE forward with a static KV cache (gpt-fast style), on the kernels of ``kernels/linear.py``.

Shape suffixes: B = sequences in a step, T = tokens per sequence in the step, S = cache length,
H = hidden, Hq / Hkv = query / KV heads, D = head dim, E = experts, V = vocab, N / K = linear out / in.

The math is Hugging Face's ``Qwen3MoeForCausalLM`` (so that fp32 mode reproduces it to fp32 rounding):
RMSNorm in fp32 then cast, q_norm / k_norm per head before RoPE (rotate-half, fp32 cos/sin cast to
the compute dtype), SDPA with GQA, router logits in the compute dtype then softmax in fp32, top-k,
renormalised when ``norm_topk_prob``, cast back; expert outputs weighted and summed in ascending
expert order (``index_add_`` as HF does; at batch 1 one weighted GEMM, which accumulates in fp32).
Attention, router, norms, embeddings and lm_head stay in the compute dtype; only linears stored
low-bit in the checkpoint run low-bit kernels.

Decode speed (benchmarks/decode.py, BENCHMARKS.md) comes from: dense bf16 GEMMs on oneDNN-prepacked
weights, the int4 / int8 kernels of ``kernels/linear.py`` (at one token, native ones that take a token's k experts
in one call), q and k normalised and rotated as one tensor, grouped-query attention as one SDPA call
without K/V copies, and a batch-1 MoE path without row bookkeeping (``Linear.rows_mm``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_qarl.errors import ConfigError
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.qat.export import iter_safetensors, scheme_of
from megatron_qarl.qat.kv_cache import FP8, KV_CACHE_DTYPES, SCALE_NAMES, kv_load_table, kv_store
from megatron_qarl.qat.kv_cache import bytes_per_element as kv_bytes_per_element
from megatron_qarl.serve.kernels.linear import DenseLinear, Linear, Store, make_linear
from megatron_qarl.sync import delta


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF Qwen3MoeRMSNorm: normalise in fp32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` in 4 ops instead of 7, with the same result: rotate_half(x) * sin
    = cat(-x2, x1) * sin = roll(x, D/2) * cat(-sin1, sin2) (a sign flip is exact)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def kv_scales(raw: dict[str, Tensor], layers: int) -> list[tuple[float, float]]:
    """Each layer's (k_scale, v_scale) as SGLang 0.5.23 serves Qwen3-MoE: 1.0 (qat/kv_cache.py says why); a
    checkpoint's scale tensors (``SCALE_NAMES``) are dropped from ``raw``, as its load_weights skips them."""
    for i in range(layers):
        for name in SCALE_NAMES:
            raw.pop(name.format(i=i), None)
    return [(1.0, 1.0)] * layers


def to_cache(x: Tensor, kv_dtype: str, scale: float, act: torch.dtype) -> Tensor:
    """What the cache stores of keys or values: ``x`` itself, or its FP8 codes (qat/kv_cache.py) as bytes."""
    return kv_store(x, scale, FP8[kv_dtype], act).view(torch.uint8) if kv_dtype in FP8 else x


def kv_tables(scales: list[tuple[float, float]], kv_dtype: str,
              act: torch.dtype) -> list[tuple[Tensor | None, Tensor | None]]:
    """Each layer's (keys', values') ``kv_load_table`` of an FP8 cache ((None, None) for auto); ConfigError naming
    --kv-cache-dtype for another name."""
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype: {kv_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_dtype not in FP8:
        return [(None, None)] * len(scales)
    return [(kv_load_table(FP8[kv_dtype], ks, act), kv_load_table(FP8[kv_dtype], vs, act)) for ks, vs in scales]


def from_cache(held: Tensor, table: Tensor | None) -> Tensor:
    """What the attention reads of cached keys or values: as held, or the FP8 codes times the scale (``kv_load``,
    looked up in its table of the 256 codes: qat/kv_cache.py ``kv_load_table``)."""
    return held if table is None else table[held.long()]


def cache_bytes_per_token(model: Qwen3MoeEngineModel) -> int:
    """Bytes an engine's cache holds per token (every layer's keys and values)."""
    return model.k_cache[:, 0, :, 0].numel() * 2 * model.k_cache.element_size()


def kv_slots(arch: Qwen3MoeArch, slots: int, length: int, cache_bytes: int, mib: float | None) -> int:
    """The KV slots: ``slots`` (--max-batch-size), at most what ``mib`` (--kv-cache-mib) holds of sequences of
    ``length`` tokens at 2 x layers x KV heads x head_dim x ``cache_bytes`` bytes per token (None: no memory bound):
    twice as many with an FP8 cache as with a bf16 one."""
    if mib is None:
        return slots
    per_seq = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * cache_bytes * length
    fits = int(mib * 2**20 // per_seq)
    if fits < 1:
        raise ConfigError(f"--kv-cache-mib: {mib:g} MiB holds no sequence of {length} tokens ({per_seq} bytes each)")
    return min(slots, fits)


class Layer:
    """One decoder layer's operands; the forward lives in ``Qwen3MoeEngineModel``."""

    def __init__(self, i: int, arch: Qwen3MoeArch, raw: Store, store: Store, dtype: torch.dtype,
                 fp8_block: int | None):
        p = f"model.layers.{i}"
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            store[f"{p}.{name}.weight"] = raw.pop(f"{p}.{name}.weight").to(dtype)  # plain, compute dtype
        self.prefix, self.index = p, i
        self.store, self.arch = store, arch
        self.ln_in, self.ln_post = store[f"{p}.input_layernorm.weight"], store[f"{p}.post_attention_layernorm.weight"]
        self.refresh()
        self.router = DenseLinear([f"{p}.mlp.gate"], raw, store, dtype)  # always in the compute dtype
        a = f"{p}.self_attn"
        self.qkv = make_linear([f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"], raw, store, dtype, fp8_block)
        self.o = make_linear([f"{a}.o_proj"], raw, store, dtype, fp8_block)
        e = f"{p}.mlp.experts"
        self.gate_up: list[Linear] = []
        self.down: list[Linear] = []
        for j in range(arch.num_experts):
            self.gate_up.append(make_linear([f"{e}.{j}.gate_proj", f"{e}.{j}.up_proj"], raw, store, dtype, fp8_block))
            self.down.append(make_linear([f"{e}.{j}.down_proj"], raw, store, dtype, fp8_block))

    def refresh(self) -> None:
        """q_norm and k_norm as one [Hq + Hkv, D] weight: q and k leave the fused qkv GEMM side by side, so
        they are normalised and rotated together (a weight update copies into the store: refresh after)."""
        a, p = self.arch, f"{self.prefix}.self_attn"
        self.qk_norm = torch.cat([self.store[f"{p}.q_norm.weight"].expand(a.num_attention_heads, -1),
                                  self.store[f"{p}.k_norm.weight"].expand(a.num_key_value_heads, -1)])

    def linears(self) -> list[Linear]:
        return [self.router, self.qkv, self.o, *self.gate_up, *self.down]


class Qwen3MoeEngineModel:
    """The network, its store of checkpoint-format tensors and a KV cache of ``slots`` sequences."""

    def __init__(self, arch: Qwen3MoeArch, tensors: dict[str, Tensor], quant_cfg: dict | None,
                 dtype: torch.dtype, slots: int, max_seq_len: int, numerics: str = "default",
                 kv_cache_dtype: str = "auto"):
        """``numerics`` "exact": every forward runs serve/exact_forward.py (numerics/ kernels, a float32 KV
        cache holding values rounded to ``dtype``), bit for bit what the learner's exact forward computes.
        ``kv_cache_dtype``: SGLang's --kv-cache-dtype (``to_cache``; exact: a float32 cache of the values read back)."""
        if arch.attention_bias:
            raise ConfigError("config.json: attention_bias=true is not supported by the embedded engine")
        self.arch, self.dtype = arch, dtype
        self.scheme, group = scheme_of(quant_cfg) if quant_cfg else ("bf16", None)
        fp8_block = group if self.scheme == "w8a8_fp8" else None
        raw = dict(tensors)
        self.kv_dtype, self.kv_scales = kv_cache_dtype, kv_scales(raw, arch.num_hidden_layers)
        self.kv_tables = kv_tables(self.kv_scales, kv_cache_dtype, dtype)
        self.store: dict[str, Tensor] = {}
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            if name not in raw:
                raise ConfigError(f"checkpoint: missing tensor {name!r}")
            if name != "lm_head.weight":
                self.store[name] = raw.pop(name).to(dtype)
        self.lm_head = DenseLinear(["lm_head"], raw, self.store, dtype)
        self.layers = [Layer(i, arch, raw, self.store, dtype, fp8_block) for i in range(arch.num_hidden_layers)]
        if raw:
            raise ConfigError(f"checkpoint: {len(raw)} unexpected tensor(s), e.g. {sorted(raw)[:3]}")
        linears = [self.lm_head, *(lin for layer in self.layers for lin in layer.linears())]
        self.owner: dict[str, Linear] = {n: lin for lin in linears for n in lin.names}
        self._dirty: dict[int, Linear] = {}  # loaded, not yet finalized (see load_tensors)
        self._loaded = False
        self.capture: list[Tensor] | None = None  # forward appends each layer's top-k expert ids here when a list
        self.slots, self.max_seq_len = slots, max_seq_len
        kv_shape = (arch.num_hidden_layers, slots, arch.num_key_value_heads, max_seq_len, arch.head_dim)
        cache_dtype = torch.float32 if numerics == "exact" else torch.uint8 if kv_cache_dtype in FP8 else dtype
        self.k_cache = torch.zeros(kv_shape, dtype=cache_dtype)
        self.v_cache = torch.zeros(kv_shape, dtype=cache_dtype)
        self.exact = None
        if numerics == "exact":
            from megatron_qarl.serve.exact_forward import ExactForward

            self.exact = ExactForward(self)
        elif numerics != "default":
            raise ConfigError(f"numerics: {numerics!r} is not one of default, exact")
        d = arch.head_dim
        inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs_SD2 = torch.arange(max_seq_len).float()[:, None] * inv_freq[None, :]
        emb_SD = torch.cat((freqs_SD2, freqs_SD2), dim=-1)
        self.cos_SD, sin_SD = emb_SD.cos().to(dtype), emb_SD.sin().to(dtype)
        self.sin_signed_SD = torch.cat([-sin_SD[:, : d // 2], sin_SD[:, d // 2 :]], dim=-1)  # see apply_rope

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: torch.dtype, slots: int, max_seq_len: int | None,
                       numerics: str = "default", kv_cache_dtype: str = "auto", kv_cache_mib: float | None = None):
        arch = Qwen3MoeArch.from_model_dir(model_dir)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        length = min(max_seq_len or arch.max_position_embeddings, arch.max_position_embeddings)
        cache_bytes = 4 if numerics == "exact" else kv_bytes_per_element(kv_cache_dtype, dtype.itemsize)
        return cls(arch, dict(iter_safetensors(model_dir)), config.get("quantization_config"), dtype,
                   kv_slots(arch, slots, length, cache_bytes, kv_cache_mib), length, numerics, kv_cache_dtype)

    # -------------------------------------------------------------------------------- weight updates
    def update_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Load checkpoint-format tensors and finalize at once (an update from disk)."""
        self.load_tensors(tensors)
        self.finalize_weights()

    def load_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Copy checkpoint-format tensors into the store in place; the linears they feed are marked for
        ``finalize_weights`` (SGLang's ``end_weight_update``), which rebuilds their packed operands.

        Every name must exist with the same shape; float tensors of unquantized weights are cast to the
        compute dtype, the tensors of quantized linears must come in their exact checkpoint dtype.
        Validates everything before writing anything.
        """
        for name, t in tensors.items():
            held = self.store.get(name)
            if held is None:
                raise ValueError(f"{name}: not a tensor of this server's checkpoint (format {self.scheme})")
            if tuple(t.shape) != tuple(held.shape):
                raise ValueError(f"{name}: shape {list(t.shape)} differs from the server's {list(held.shape)}")
            castable = held.dtype == self.dtype and t.is_floating_point() and t.dtype != torch.float8_e4m3fn
            if t.dtype != held.dtype and not castable:
                raise ValueError(f"{name}: dtype {t.dtype} differs from the server's {held.dtype}")
        with torch.no_grad():
            for name, t in tensors.items():
                self.store[name].copy_(t)
                if name in self.owner:
                    self._dirty[id(self.owner[name])] = self.owner[name]
        self._loaded = self._loaded or bool(tensors)

    def apply_deltas(self, parts: dict[str, tuple[Tensor, Tensor]]) -> None:
        """Apply delta-sync parts (name -> (block index, block values), sync/delta.py) to the store in place:
        ``T.view(n / b, b)[index] = values``; the linears they feed are marked for ``finalize_weights``, as
        ``load_tensors`` does. Validates every part (a tensor of this checkpoint; index and values that fit
        it; the same dtype rule as ``load_tensors``) before writing anything."""
        for name, (index, values) in parts.items():
            held = self.store.get(name)
            if held is None:
                raise ValueError(f"{name}: not a tensor of this server's checkpoint (format {self.scheme})")
            delta.check(name, held, index, values, castable=held.dtype == self.dtype)
        with torch.no_grad():
            for name, (index, values) in parts.items():
                delta.apply(self.store[name], index, values)
                if name in self.owner:
                    self._dirty[id(self.owner[name])] = self.owner[name]
        self._loaded = self._loaded or bool(parts)

    def finalize_weights(self) -> int:
        """Rebuild the derived operands (prepacked / repacked low-bit weights, fused norms) of everything
        loaded since the last call; returns how many linears were rebuilt."""
        dirty, self._dirty = list(self._dirty.values()), {}
        if self.exact is not None and (dirty or self._loaded):
            self.exact.invalidate()
        for lin in dirty:
            lin.refresh()
        if self._loaded:
            for layer in self.layers:
                layer.refresh()
        self._loaded = False
        return len(dirty)

    # ------------------------------------------------------------------------------------- forward
    def _attention(self, layer: Layer, x_BTH: Tensor, slots_B: Tensor, pos_BT: Tensor, kv_len: int,
                   rope: tuple[Tensor, Tensor]) -> Tensor:
        a = self.arch
        b, t, _ = x_BTH.shape
        hq, hkv, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        qkv = layer.qkv(x_BTH.reshape(b * t, -1))
        qk = rms_norm(qkv[:, : (hq + hkv) * d].view(b, t, hq + hkv, d), layer.qk_norm, a.rms_norm_eps)
        qk_BHTD = apply_rope(qk.transpose(1, 2), *rope)
        q_BHTD, k_BHTD = qk_BHTD[:, :hq], qk_BHTD[:, hq:]
        v_BHTD = qkv[:, (hq + hkv) * d :].view(b, t, hkv, d).transpose(1, 2)
        kc, vc = self.k_cache[layer.index], self.v_cache[layer.index]  # [slots, Hkv, S, D]
        (ks, vs), kv, act = self.kv_scales[layer.index], self.kv_dtype, self.dtype
        k_BHTD, v_BHTD = to_cache(k_BHTD, kv, ks, act), to_cache(v_BHTD, kv, vs, act)
        if b == 1 and (t == 1 or t == kv_len):
            # one sequence (batch-1 decode, or a prefill from position 0): the cache rows are a view
            # and need no mask (decode: every cached position is visible; prefill: plain causal)
            slot, start = int(slots_B[0]), kv_len - t
            kc[slot, :, start:kv_len] = k_BHTD[0]
            vc[slot, :, start:kv_len] = v_BHTD[0]
            keys, values = kc[slot : slot + 1, :, :kv_len], vc[slot : slot + 1, :, :kv_len]
            mask = None
        else:
            bidx = slots_B[:, None].expand(b, t)
            kc[bidx, :, pos_BT] = k_BHTD.transpose(1, 2)  # advanced indices first: [B, T, Hkv, D]
            vc[bidx, :, pos_BT] = v_BHTD.transpose(1, 2)
            keys, values = kc[slots_B, :, :kv_len], vc[slots_B, :, :kv_len]  # [B, Hkv, L, D]
            mask = (torch.arange(kv_len)[None, None, :] <= pos_BT[:, :, None])[:, None]  # [B, 1, T, L]
        # every key read comes from the cache, the new tokens' too (SGLang's paged attention: quantization.md)
        kt, vt = self.kv_tables[layer.index]
        keys, values = from_cache(keys, kt), from_cache(values, vt)
        o_BHTD = self._sdpa(q_BHTD, keys, values, mask)
        return layer.o(o_BHTD.transpose(1, 2).reshape(b * t, -1)).view(b, t, -1)

    def _sdpa(self, q_BHTD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, mask_B1TL: Tensor | None) -> Tensor:
        """Attention with grouped KV heads (query head h reads KV head h // rep, as HF's ``repeat_kv``).

        Decode (T = 1): the ``rep`` query heads of a KV head become ``rep`` query rows against that head's
        keys, so one SDPA call needs neither a copy of K/V per query head nor ``enable_gqa`` (whose CPU
        path costs ~10x more at decode: 256 us vs 25 us at 50 cached tokens, bf16). Prefill: HF's
        ``repeat_kv`` then SDPA (causal without a mask for a single sequence from position 0).
        """
        b, h, t, d = q_BHTD.shape
        g = k_BGLD.shape[1]
        rep, scale = h // g, d**-0.5
        if t == 1:
            o = F.scaled_dot_product_attention(q_BHTD.reshape(b, g, rep, d), k_BGLD, v_BGLD,
                                               attn_mask=mask_B1TL, scale=scale)
            return o.reshape(b, h, 1, d)
        k = k_BGLD[:, :, None].expand(b, g, rep, *k_BGLD.shape[2:]).reshape(b, h, *k_BGLD.shape[2:])
        v = v_BGLD[:, :, None].expand(b, g, rep, *v_BGLD.shape[2:]).reshape(b, h, *v_BGLD.shape[2:])
        return F.scaled_dot_product_attention(q_BHTD, k, v, attn_mask=mask_B1TL, is_causal=mask_B1TL is None,
                                              scale=scale)

    def _moe(self, layer: Layer, x_TH: Tensor) -> Tensor:
        a = self.arch
        logits_TE = layer.router(x_TH)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float)
        top_TK, idx_TK = torch.topk(probs_TE, a.num_experts_per_tok, dim=-1)
        if self.capture is not None:  # routed experts (R3): SGLang's order, the top-k order of this forward
            self.capture.append(idx_TK.to(torch.int32))
        if a.norm_topk_prob:
            top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
        top_TK = top_TK.to(x_TH.dtype)
        # Routing bookkeeping in Python lists: at decode a handful of tokens meet a handful of experts, and
        # per-expert tensor ops (where / index / index_add_) cost more than the expert GEMMs themselves.
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for t, row in enumerate(idx_TK.tolist()):
            for k, e in enumerate(row):
                groups.setdefault(e, ([], []))[0].append(t)
                groups[e][1].append(k)
        experts = sorted(groups)  # ascending expert id, as HF accumulates
        # W8A8 quantizes activations per token (row-wise): once for all experts' gate_up, once for all downs
        x_in = layer.gate_up[experts[0]].prepare(x_TH)
        if x_TH.shape[0] == 1:  # batch-1 decode: no row bookkeeping; one weighted GEMM sums the top-k outputs
            gate_up, down = [layer.gate_up[e] for e in experts], [layer.down[e] for e in experts]
            y = type(gate_up[0]).rows_mm(gate_up, x_in)  # [k, 2I]: gate | up per expert
            n = gate_up[0].splits[0]
            h_in = down[0].prepare(F.silu(y[:, :n]) * y[:, n:])
            ys = type(down[0]).rows_mm(down, h_in)  # [k, H]
            return torch.mm(top_TK[:, [groups[e][1][0] for e in experts]], ys)
        h_parts = []
        for e in experts:
            gate, up = layer.gate_up[e].split(layer.gate_up[e].mm(x_in[groups[e][0]]))
            h_parts.append(F.silu(gate) * up)
        h_in = layer.down[experts[0]].prepare(torch.cat(h_parts) if len(h_parts) > 1 else h_parts[0])
        out_TH = torch.zeros_like(x_TH)
        row = 0
        for e, h in zip(experts, h_parts, strict=True):
            tok, kpos = groups[e]
            y = layer.down[e].mm(h_in[row : row + h.shape[0]]) * top_TK[tok, kpos, None]
            row += h.shape[0]
            out_TH[tok] += y  # a token meets an expert at most once: rows of ``tok`` are distinct
        return out_TH

    def forward_routed(self, tokens_BT: Tensor, slots_B: Tensor, pos_BT: Tensor,
                       all_logits: bool = False) -> tuple[Tensor, Tensor]:
        """``forward``, plus the experts each token was routed to: int32 [B, T, layers, top-k]."""
        self.capture = []
        try:
            logits = self.forward(tokens_BT, slots_B, pos_BT, all_logits)
            routes_BTLK = torch.stack(self.capture, dim=1).view(*tokens_BT.shape, len(self.layers), -1)
        finally:
            self.capture = None
        return logits, routes_BTLK

    @torch.inference_mode()
    def forward(self, tokens_BT: Tensor, slots_B: Tensor, pos_BT: Tensor, all_logits: bool = False) -> Tensor:
        """Run tokens ``tokens_BT`` at positions ``pos_BT`` for cache slots ``slots_B``; writes their K/V.

        Positions of a row must be consecutive from the row's cached length (prefill: 0..T-1; decode: the
        next position). Returns fp32 logits of the last token of each row [B, V] (all tokens [B, T, V]
        when ``all_logits``).
        """
        if self.exact is not None:
            return self.exact.forward(tokens_BT, slots_B, pos_BT, all_logits)
        a, s = self.arch, self.store
        b, t = tokens_BT.shape
        kv_len = int(pos_BT.max()) + 1
        x = F.embedding(tokens_BT, s["model.embed_tokens.weight"])
        rope = self.cos_SD[pos_BT][:, None], self.sin_signed_SD[pos_BT][:, None]  # [B, 1, T, D], for every layer
        for layer in self.layers:
            x = x + self._attention(layer, rms_norm(x, layer.ln_in, a.rms_norm_eps), slots_B, pos_BT, kv_len, rope)
            n = rms_norm(x, layer.ln_post, a.rms_norm_eps)
            x = x + self._moe(layer, n.reshape(b * t, -1)).view(b, t, -1)
        x = rms_norm(x if all_logits else x[:, -1:], s["model.norm.weight"], a.rms_norm_eps)
        logits = self.lm_head(x.reshape(-1, a.hidden_size)).float()
        return logits.view(b, -1, a.vocab_size) if all_logits else logits
