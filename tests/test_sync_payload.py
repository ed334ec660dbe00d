"""The sync payload is the server's checkpoint format of the learner's low-bit weights, any layout."""

from __future__ import annotations

import pytest
import torch

from megatron_qarl.config import OptimConfig, ParallelConfig
from megatron_qarl.learner.rank import Learner
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.parallelize import init_parallel, run_ranks
from megatron_qarl.moe.verify import world_size
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.export import iter_safetensors, quantize_checkpoint
from megatron_qarl.sync.payload import iter_sync_tensors


def _payload(model_dir: str, scheme: str, tp: int, ep: int, num_bits: int = 4) -> dict | None:
    import torch.distributed as dist

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep)
    quant = QuantConfig(scheme=scheme, num_bits=num_bits)
    learner = Learner(arch, ParallelConfig(tp=tp, ep=ep), OptimConfig(), quant=quant)
    learner.load_hf(model_dir)
    out = dict(iter_sync_tensors(learner, dtype=torch.float32))
    return out if dist.get_rank() == 0 else None


@pytest.mark.multiproc
@pytest.mark.parametrize("scheme", ["w4a16", "w8a8_int8"])
@pytest.mark.parametrize("tp, ep", [(1, 1), (1, 2), (2, 2)])
def test_payload_equals_the_offline_sglang_checkpoint(scheme, tp, ep, tiny_model_dir, tmp_path):
    quantize_checkpoint(tiny_model_dir, scheme, tmp_path)
    offline = dict(iter_safetensors(tmp_path))
    payload = run_ranks(world_size(tp, ep), _payload, tiny_model_dir, scheme, tp, ep)[0]
    assert sorted(payload) == sorted(offline)
    for name, tensor in offline.items():
        assert payload[name].dtype == tensor.dtype, name
        assert torch.equal(payload[name], tensor), name


@pytest.mark.multiproc
@pytest.mark.parametrize("num_bits", [3, 2])
def test_low_bit_payload_is_the_int4_checkpoint_of_the_b_bit_codes(num_bits, tiny_model_dir, tmp_path):
    """2/3-bit codes travel as int4 (weight_packed) with their scales: the offline export, byte for byte."""
    from megatron_qarl.qat.pack import unpack_int4

    quantize_checkpoint(tiny_model_dir, "w4a16", tmp_path, num_bits=num_bits)
    offline = dict(iter_safetensors(tmp_path))
    payload = run_ranks(1, _payload, tiny_model_dir, "w4a16", 1, 1, num_bits)[0]
    assert sorted(payload) == sorted(offline)
    for name, tensor in offline.items():
        assert torch.equal(payload[name], tensor), name
    packed = [n for n in payload if n.endswith(".weight_packed")]
    assert packed
    for name in packed:
        k = int(payload[name.replace("_packed", "_shape")][1])
        codes = unpack_int4(payload[name], k)
        assert int(codes.min()) >= -(2 ** (num_bits - 1)) and int(codes.max()) <= 2 ** (num_bits - 1) - 1
