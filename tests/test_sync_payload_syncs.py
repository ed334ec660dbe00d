"""What a weight sync's payload reads to the host, counted on CPU with tests/test_learner_launches.py's harness
(issue 48): ``iter_sync_tensors`` over every target, after a train step (so every quantized weight is refreshed).

A host read is an op that hands a device value to Python (``SYNCS``); a tensor made from host data
(``aten.lift_fresh``: ``torch.tensor(list, device=...)``, on a GPU a pageable host-to-device copy that waits for the
stream) and a copy between devices are counted beside them. Before, W4A16's ``pack_int4`` read each tensor's code
range (2 reads per tensor), ``weight_shape`` was made per tensor, and ``target_codes`` read the finiteness flag per
target: at EP8 on Qwen3-30B-A3B about 7k syncs per weight sync. Now the ranks agree on every flag with one read
(``check_sendable``) and nothing else reads or makes a tensor per expert."""

from __future__ import annotations

import pytest
import torch
from test_learner_launches import SCHEMES, Count, arch_with

from megatron_qarl.moe.parallelize import init_parallel, run_ranks

MADE = {"aten.lift_fresh.default", "aten.lift_fresh_copy.default"}


class Moves(Count):
    """Count, and the copies from one device to another (``aten._to_copy`` with another device)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and (kwargs or {}).get("device") is not None and \
                torch.device(kwargs["device"]) != args[0].device:
            self.ops["cross-device copy"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _payload(scheme: str, experts: int) -> dict:
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.sync.payload import iter_sync_tensors

    torch.manual_seed(0)
    learner = Learner(arch_with(experts), ParallelConfig(), OptimConfig(lr=1e-5), quant=QuantConfig(scheme=scheme))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    learner.train_step(Batch(tokens, torch.ones(2, 15)), lambda lp, b: token_mean_nll(lp, b, 30))
    with torch.no_grad(), Moves() as c:
        n = sum(1 for _ in iter_sync_tensors(learner, torch.bfloat16))
    return {"tensors": n, "stacks": len(learner.fake_quant.stacks), "syncs": c.syncs,
            "made": sum(c.ops[op] for op in MADE), "moves": c.ops["cross-device copy"]}


def _all() -> dict:
    init_parallel()
    return {(s, e): _payload(s, e) for s in SCHEMES for e in (8, 32)}


@pytest.fixture(scope="module")
def payloads() -> dict:
    return run_ranks(1, _all)[0]


def test_the_table_of_what_a_sync_payload_reads(payloads):
    print("\nscheme     experts  tensors  stacks  host reads  made from host  cross-device copies")
    for (scheme, e), r in payloads.items():
        print(f"{scheme:10} {e:7}  {r['tensors']:7}  {r['stacks']:6}  {r['syncs']:10}  {r['made']:14}  "
              f"{r['moves']:19}")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_sync_payload_reads_the_host_once_whatever_the_experts(payloads, scheme):
    small, large = payloads[(scheme, 8)], payloads[(scheme, 32)]
    assert large["tensors"] > small["tensors"]  # 4x the experts' tensors ...
    for key in ("syncs", "made", "moves"):  # ... and not one read, host tensor or copy more
        assert small[key] == large[key], (key, small, large)
    assert small["syncs"] == 1, small  # check_sendable's read of every rank's finiteness flags
    assert small["made"] <= small["stacks"], small  # W4A16's weight_shape: once per stack (here once per shape)
    assert small["moves"] == 0, small


def test_pack_int4_reads_nothing_unless_asked_and_its_shifts_are_made_once_per_device():
    from megatron_qarl.qat.pack import pack_int4, unpack_int4

    codes = torch.randint(-8, 8, (16, 40), dtype=torch.int8)
    with Moves() as c:
        packed = pack_int4(codes)
        pack_int4(torch.empty((16, 40), dtype=torch.int8, device="meta"))  # no value to read, none read
        pack_int4(torch.empty((16, 40), dtype=torch.int8, device="meta"))
    assert c.syncs == 0 and c.ops["cross-device copy"] == 0, c.ops
    assert torch.equal(unpack_int4(packed, 40), codes)
    with pytest.raises(ValueError, match=r"outside \[-8, 7\]"):
        pack_int4(torch.full((2, 8), 9, dtype=torch.int8), check=True)
