"""Fake quantization inside the Megatron model, without editing Megatron: a visible wrapper.

`apply_fake_quant(model, arch, cfg)` attaches a pre/post forward hook pair to every Megatron linear
whose Hugging Face tensors the config quantizes (compressed-tensors targets / ignore semantics,
megatron_qarl.qat.config.is_quantized). During that module's forward:

    weight  <- straight_through(master, hf_to_shard(dequantize(quantize(hf_tensors(master)))))
    input   <- straight_through(x, quant_act(x))                       (W8A8 schemes only)

The unit of quantization is always the Hugging Face tensor the rollout engine loads (q_proj, k_proj,
v_proj separately, gate_proj and up_proj separately), never Megatron's fused or sharded one: when a
layer is split over tensor / expert-tensor parallel ranks, the shards are all-gathered, quantized
whole and sliced back, so the learner's low-bit weights equal the exported ones for any layout.
Row-parallel inputs (split along K) are gathered the same way for the W8A8 per-token scales.

Quantization runs once per weight version: the QuantizedWeights are cached until the master
weight changes (or `invalidate()`), and `quantized_weights()` hands the exporter / weight sync the
very codes and scales the forward used: nothing is quantized twice.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from megatron_qarl.moe.convert import Layout, ParamMap, hf_to_shard, param_maps, shards_to_hf
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.parallelize import all_gather_tensors, to_group_device
from megatron_qarl.qat.config import QuantConfig, is_quantized
from megatron_qarl.qat.fake_quant import fake_quant_act, straight_through
from megatron_qarl.qat.quantizer import QuantizedWeight, quantize_weight

# Megatron parameter split kinds that are linear weights, and whether K (dim 1) is the split dim
_LINEAR_SPLITS = {"qkv": False, "tp_row": False, "tp_col": True, "fc1": False, "fc2": True}


@dataclasses.dataclass
class _Target:
    pm: ParamMap
    module: torch.nn.Module
    param: torch.nn.Parameter  # the master weight
    group: object | None  # process group the weight is split over (None: not split)
    size: int
    rank: int
    splits_k: bool
    version: tuple | None = None
    quantized: dict[str, QuantizedWeight] | None = None
    local_fq: Tensor | None = None  # dequantized local shard (no autograd)


class FakeQuant:
    """The hooks on one rank's model; `remove()` takes them off."""

    def __init__(self, model: torch.nn.Module, arch: Qwen3MoeArch, cfg: QuantConfig, layout: Layout | None = None,
                 forward: bool = True):
        from megatron.core import parallel_state as ps

        if not cfg.enabled:
            raise ValueError("quant.scheme is bf16: there is nothing to fake-quantize")
        self.arch, self.cfg = arch, cfg
        self.layout = layout or Layout.current()
        self.targets: list[_Target] = []
        self._handles = []
        lay = self.layout
        for pm in param_maps(arch, lay.ep_rank, lay.ep):
            if pm.split not in _LINEAR_SPLITS:
                continue
            chosen = [is_quantized(n.removesuffix(".weight"), cfg) for n in pm.hf]
            if not any(chosen):
                continue
            if not all(chosen):
                raise ValueError(f"quant.ignore: {pm.hf} share Megatron's {pm.mcore}; quantize all or none")
            if pm.split in ("fc1", "fc2"):
                group, size, rank = ps.get_expert_tensor_parallel_group(), lay.etp, lay.etp_rank
            else:
                group, size, rank = ps.get_tensor_model_parallel_group(), lay.tp, lay.tp_rank
            module = model.get_submodule(pm.mcore.removesuffix(".weight"))
            target = _Target(pm, module, module.weight, group if size > 1 else None, size, rank,
                             _LINEAR_SPLITS[pm.split])
            self.targets.append(target)
            if forward:  # else: quantize for export only (a BF16 learner feeding a low-bit rollout)
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(target)))
                self._handles.append(module.register_forward_hook(self._post_hook(target), always_call=True))

    # ------------------------------------------------------------------ quantization, cached per version
    def _refresh(self, t: _Target) -> None:
        master = t.param
        version = (master._version, master.data_ptr())
        if t.version == version and t.quantized is not None:
            return
        with torch.no_grad():
            w = master.detach()
            shards = ([w] if t.group is None else
                      all_gather_tensors(to_group_device(w, t.group), t.group, t.size, name=t.pm.mcore))
            hf = shards_to_hf(t.pm, shards, self.arch)
            t.quantized = {name: quantize_weight(tensor, self.cfg, name) for name, tensor in hf.items()}
            deq = {name: qw.dequantize(w.dtype) for name, qw in t.quantized.items()}
            t.local_fq = hf_to_shard(t.pm, deq.__getitem__, self.arch, self.layout).contiguous()
        t.version = version

    def invalidate(self) -> None:
        """Forget every cached quantization (after weights change behind autograd's back)."""
        for t in self.targets:
            t.version = t.quantized = t.local_fq = None

    def target_codes(self, t: _Target) -> dict[str, QuantizedWeight]:
        """Hugging Face name -> the QuantizedWeight of one target, as this rank's forward uses it (the very
        codes a weight sync sends; quantized once per optimizer step)."""
        self._refresh(t)
        return t.quantized

    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        """Hugging Face name -> the QuantizedWeight this rank's forward uses (its own experts only)."""
        out = {}
        for t in self.targets:
            self._refresh(t)
            out.update(t.quantized)
        return out

    def fake_quant_shard(self, mcore_name: str) -> Tensor:
        """The fake-quant local weight the forward of ``mcore_name`` computes with (no autograd)."""
        t = next(t for t in self.targets if t.pm.mcore == mcore_name)
        self._refresh(t)
        return t.local_fq

    # ------------------------------------------------------------------------------------------- hooks
    def _pre_hook(self, t: _Target):
        def hook(module, args):
            self._refresh(t)
            module._parameters["weight"] = straight_through(t.param, t.local_fq)
            if self.cfg.scheme in ("w8a8_fp8", "w8a8_int8"):
                return (self._quant_input(t, args[0]),) + tuple(args[1:])
            return None

        return hook

    @staticmethod
    def _post_hook(t: _Target):
        def hook(module, args, output):
            module._parameters["weight"] = t.param  # the master weight is back after every forward

        return hook

    def _quant_input(self, t: _Target, x: Tensor) -> Tensor:
        if not (t.splits_k and t.group is not None):
            return fake_quant_act(x, self.cfg)
        with torch.no_grad():  # per-token scales need the whole row: gather K, quantize, slice back
            x_local = to_group_device(x.detach(), t.group)
            full = torch.cat(all_gather_tensors(x_local, t.group, t.size, name=f"input of {t.pm.mcore}"), dim=-1)
            x_fq = fake_quant_act(full, self.cfg).chunk(t.size, dim=-1)[t.rank]
        return straight_through(x, x_fq.contiguous())

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def apply_fake_quant(model: torch.nn.Module, arch: Qwen3MoeArch, cfg: QuantConfig, forward: bool = True) -> FakeQuant:
    """Attach fake quantization to this rank's (unwrapped) Megatron model; returns the handle.

    ``forward=False`` attaches no hooks: the model computes in high precision while the handle still
    quantizes its weights for the rollout servers (unaligned quantized rollout, the baseline)."""
    return FakeQuant(model, arch, cfg, forward=forward)
