"""Delta weight sync's pure functions (megatron_qarl/sync/delta.py) and the engine model applying deltas."""

from __future__ import annotations

import re
import types

import pytest
import torch

from megatron_qarl.qat.export import iter_safetensors, quantize_checkpoint
from megatron_qarl.serve.model import Qwen3MoeEngineModel
from megatron_qarl.sync import delta


def _changed(t: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """A copy of ``t`` with the elements at the flat ``positions`` changed (bitwise)."""
    out = t.clone()
    flat = out.view(-1).view(delta._INT[t.element_size()])
    flat[positions] = flat[positions] ^ 1  # flip the lowest bit: a one-ulp change of a float
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32, torch.float8_e4m3fn])
def test_apply_of_diff_gives_the_new_tensor_bit_for_bit_at_every_block_size(dtype):
    gen = torch.Generator().manual_seed(0)
    old = (torch.randn(8, 64, generator=gen) * 0.02).to(dtype) if dtype != torch.int32 else \
        torch.randint(-2**31, 2**31 - 1, (8, 64), dtype=torch.int32, generator=gen)
    new = _changed(old, [0, 5, 64 * 3 + 7, 64 * 3 + 8, 511])
    for block in [*delta.candidate_blocks(old.shape), None]:
        held = old.clone()
        d = delta.diff("w", old, new, block)
        delta.apply(held, d.index, d.values)
        assert torch.equal(held.view(-1).view(torch.uint8), new.view(-1).view(torch.uint8)), block


def test_signed_zero_and_nan_payloads_count_as_changes():
    old = torch.tensor([0.0, float("nan"), 1.0], dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0
    new.view(torch.int16)[1] ^= 1  # another NaN payload
    assert delta.changed_mask(old, new).tolist() == [True, True, False]
    assert delta.diff("w", new, new.clone()) is None


def test_wire_bytes_is_changed_blocks_times_block_bytes_plus_index():
    assert delta.wire_bytes(3, 16, 1024, 4) == 3 * (16 * 4 + 4)  # int32 index: 64 blocks
    assert delta.wire_bytes(2, 1, 2**31, 2) == 2 * (2 + 8)  # 2^31 blocks need an int64 index
    assert delta.index_dtype(2**31 - 1) == torch.int32 and delta.index_dtype(2**31) == torch.int64


def test_candidate_blocks_are_element_powers_of_two_row_and_tensor():
    assert delta.candidate_blocks((4, 96)) == [1, 2, 4, 8, 16, 32, 96, 384]  # 96 = 32 * 3
    assert delta.candidate_blocks((10,)) == [1, 2, 10]
    assert delta.candidate_blocks((3, 7)) == [1, 7, 21]


def test_the_cheapest_block_is_chosen():
    """Scattered elements -> b = 1; whole W4A16 groups (16 int32 words) -> 16; every row -> the tensor."""
    packed = torch.zeros(32, 64, dtype=torch.int32)  # 32 rows x 4 groups of 16 words
    scattered = _changed(packed, [3, 700, 1500])
    group = packed.clone()
    group.view(-1, 16)[[5, 77]] += 1
    everything = packed + 1
    for new, want in ((scattered, 1), (group, 16), (everything, packed.numel())):
        elements = delta.changed_elements(packed, new)
        b, costs = delta.choose_block(elements, packed.shape, 4)
        assert b == want and costs[b] == min(costs.values())
        mask = delta.changed_mask(packed, new)  # |C_b| from the positions equals counting on the mask
        assert all(k == int(mask.view(-1, b).any(dim=1).sum()) for b, k in delta.changed_blocks(
            elements, delta.candidate_blocks(packed.shape)).items())
    b, _ = delta.choose_block(delta.changed_elements(packed, packed.clone()), packed.shape, 4)
    assert b == 0


def test_check_refuses_with_the_tensor_name():
    held = torch.zeros(4, 32, dtype=torch.int32)
    idx = torch.tensor([0, 2], dtype=torch.int32)
    vals = torch.ones(2, 16, dtype=torch.int32)
    delta.check("x.weight_packed", held, idx, vals, castable=False)  # a valid one passes
    cases = [
        (idx.float(), vals, "x.weight_packed.delta_index: must be 1-D int32 or int64"),
        (torch.tensor([0, 8]), vals, r"x.weight_packed.delta_index: block numbers \[0, 8\] outside \[0, 8\)"),
        (torch.tensor([-1, 2]), vals, "outside"),
        (torch.tensor([2, 0]), vals, "x.weight_packed.delta_index: block numbers must be sorted and distinct"),
        (torch.tensor([2, 2]), vals, "sorted and distinct"),
        (idx, vals[:1], r"x.weight_packed.delta_values: shape \[1, 16\] is not \[len\(index\) = 2, block\]"),
        (idx, torch.ones(2, 48, dtype=torch.int32), "x.weight_packed.delta_values: block 48 does not divide"),
        (idx, vals.to(torch.int16), "x.weight_packed.delta_values: dtype torch.int16 differs"),
    ]
    for i, v, message in cases:
        with pytest.raises(ValueError, match=message):
            delta.check("x.weight_packed", held, i, v, castable=False)
    # a high-precision tensor of the compute dtype takes any float dtype (cast as a full load would)
    delta.check("n.weight", torch.zeros(8), torch.tensor([1]), torch.ones(1, 4, dtype=torch.bfloat16), castable=True)


def test_pair_parts_names_an_unpaired_or_foreign_tensor():
    i, v = torch.tensor([0]), torch.ones(1, 2)
    assert set(delta.pair_parts({"a.delta_index": i, "a.delta_values": v})) == {"a"}
    with pytest.raises(ValueError, match="a: .delta_index came without its partner"):
        delta.pair_parts({"a.delta_index": i})
    with pytest.raises(ValueError, match="a.weight: not a delta tensor"):
        delta.pair_parts({"a.weight": v})


def test_baseline_encodes_deltas_and_advances_to_the_payload():
    gen = torch.Generator().manual_seed(1)
    first = {"a": torch.randn(16, 8, generator=gen), "b": torch.randint(0, 9, (4, 32), dtype=torch.int32)}
    base = delta.Baseline()
    assert [n for n, _ in base.record(first.items())] == ["a", "b"]
    server = {n: t.clone() for n, t in first.items()}
    second = {"a": _changed(first["a"], [1, 2, 3]), "b": first["b"].clone()}
    deltas = list(base.encode(second.items()))
    assert [d.name for d in deltas] == ["a"]  # b unchanged: not sent
    for d in deltas:
        delta.apply(server[d.name], d.index, d.values)
    for n in first:
        assert torch.equal(server[n], second[n]) and torch.equal(base.tensors[n], second[n])
    with pytest.raises(ValueError, match="b: not in the last full sync"):
        list(base.encode([("a", second["a"]), ("b", torch.zeros(4, 16, dtype=torch.int32))]))
    with pytest.raises(ValueError, match="the payload has 1 tensors, the last full sync 2"):
        list(base.encode([("a", second["a"])]))


def test_engine_model_applying_a_delta_equals_loading_the_full_tensors(tiny_model_dir, tmp_path):
    """A W4A16 engine model: deltas of a perturbed checkpoint, applied and finalized, leave the store and
    the logits exactly as loading the perturbed tensors whole."""
    qdir = quantize_checkpoint(tiny_model_dir, "w4a16", tmp_path / "w4a16")
    old = dict(iter_safetensors(qdir))
    gen = torch.Generator().manual_seed(2)
    new = {}
    for name, t in old.items():
        n = t.numel()
        positions = torch.randperm(n, generator=gen)[: max(1, n // 100)].tolist()
        new[name] = t if name.endswith("weight_shape") else _changed(t, positions)
    by_delta = Qwen3MoeEngineModel.from_model_dir(qdir, torch.float32, 1, 32)
    whole = Qwen3MoeEngineModel.from_model_dir(qdir, torch.float32, 1, 32)
    parts = {d.name: (d.index, d.values) for n in old if (d := delta.diff(n, old[n], new[n])) is not None}
    assert "model.layers.0.mlp.experts.0.down_proj.weight_packed" in parts
    by_delta.apply_deltas(parts)
    assert by_delta.finalize_weights() > 0
    whole.update_tensors(new)
    for name, t in whole.store.items():
        assert torch.equal(by_delta.store[name], t), name
    tokens = torch.tensor([[3, 9, 4, 17, 5]])
    pos = torch.arange(5)[None]
    logits = [m.forward(tokens, torch.tensor([0]), pos) for m in (by_delta, whole)]
    assert torch.equal(logits[0], logits[1])
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.0.up_proj.weight_scale.delta_index"):
        by_delta.apply_deltas({"model.layers.0.mlp.experts.0.up_proj.weight_scale": (
            torch.tensor([10**6]), torch.ones(1, 1, dtype=torch.bfloat16))})
    with pytest.raises(ValueError, match="no.such.weight: not a tensor of this server's checkpoint"):
        by_delta.apply_deltas({"no.such.weight": (torch.tensor([0]), torch.ones(1, 1))})


class _Work:
    """A broadcast handle that completes ``after`` seconds from now (None: never)."""

    def __init__(self, after: float | None):
        import time

        self.at = None if after is None else time.monotonic() + after

    def is_completed(self) -> bool:
        import time

        return self.at is not None and time.monotonic() >= self.at

    def wait(self) -> None:
        assert self.is_completed()


@pytest.mark.parametrize("message, lag, kept", [
    ("Failed to update parameter online: model.x.delta_values: dtype differs", 0.3, True),
    ("Failed to update parameter online: model.x.delta_values: dtype differs", None, False),
    ("update_weights_from_distributed must run between begin_weight_update() and end_weight_update()", 0.0, False),
])
def test_a_refusal_that_outruns_the_last_send_keeps_the_group(message, lag, kept, monkeypatch):
    """CI's failure on a loaded 2-core machine: the server refused a bad delta after receiving the whole bucket,
    and its answer came before this side's communication thread marked the sends complete; the transport took
    it for a refusal before receiving and destroyed the group, and the next bucket met no group. A refusal after
    receiving (SGLang's "Failed to update parameter online") while the sends complete within ``ANSWER_GRACE_S``
    keeps the group; sends that never complete end it, and so does a refusal before receiving even where the
    root's sends completed (NCCL's root can finish a small bucket into its buffers; gloo relays through a tree).
    Either way the error names the server's refusal."""
    from megatron_qarl.sync import transport as transport_mod
    from megatron_qarl.sync.weight_update import Engine, SyncError, WeightUpdateAPI

    class Refusing(WeightUpdateAPI):
        def update_weights_from_distributed(self, *args, **kwargs):
            return {"success": False, "message": message}

    monkeypatch.setattr(transport_mod, "to_group_device", lambda t, group: t)
    monkeypatch.setattr(transport_mod, "broadcast", lambda *a, **k: _Work(lag))
    monkeypatch.setattr(transport_mod, "ANSWER_GRACE_S", 2.0)
    t = transport_mod.BroadcastTransport([Engine("http://server.test")], api_cls=Refusing, master_port=1)
    group = t.group = object()
    closed = []
    monkeypatch.setattr(t, "close", lambda: closed.append(True))
    report = types.SimpleNamespace(bytes=0, tensors=0, buckets=0)
    with pytest.raises(SyncError, match=re.escape(message)) as err:
        t.send([("model.x.delta_values", torch.zeros(2))], "v1", report, None, delta.LOAD_FORMAT)
    assert ("abandoned" in str(err.value)) is (lag is None)
    assert (t.group is group and not closed) if kept else closed == [True]


def test_a_bucket_without_a_group_is_refused_naming_it():
    from megatron_qarl.sync.transport import BroadcastTransport
    from megatron_qarl.sync.weight_update import Engine, SyncError

    t = BroadcastTransport([Engine("http://server.test")], group_name="g1", master_port=1)
    with pytest.raises(SyncError, match="no weight-update group 'g1'.*connect"):
        t.send([("w", torch.zeros(1))], "v1", None, None)


def test_the_weight_update_group_outlives_the_syncs_deadline_and_closes_its_own_side_first(monkeypatch):
    """Issue 53 item 3: the group was created with the same timeout as the broadcast's Python deadline, and close()
    waited up to 30 s on the servers' destroy calls before destroying the local group: on NCCL the watchdog (which
    starts an op's clock when it is enqueued) ended rank 0 before its SyncError. Now the group waits
    rollout.sync.timeout_s + wire.GROUP_MARGIN_S, and close() destroys (on NCCL: aborts) its side first, then tells
    the servers. Here a group of the trainer alone (gloo), its timeout read from the backend."""
    import torch.distributed as dist

    from megatron_qarl.moe.parallelize import free_port
    from megatron_qarl.sync.transport import BroadcastTransport
    from megatron_qarl.sync.weight_update import Engine, WeightUpdateAPI

    t = BroadcastTransport([], timeout_s=7.0, master_port=free_port(), backend="gloo")
    t.connect()
    assert t.group._get_backend(torch.device("cpu")).options._timeout.total_seconds() == 7.0 + 60.0
    order = []
    api = WeightUpdateAPI(Engine("http://127.0.0.1:9"))
    api.destroy_group = lambda name: order.append(f"the server told to destroy {name}")
    t.apis = [api]
    real = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda group: (order.append("the local side"), real(group)))
    t.close()
    assert order == ["the local side", "the server told to destroy weight_update_group"]
    assert t.group is None


def test_the_other_ranks_wait_for_each_of_the_payloads_collectives_on_nccl_only(monkeypatch):
    """On NCCL a collective's wait() does not block the host: a rank other than 0 that did not wait for each gather
    would queue the whole payload ahead of rank 0, each op's timeout running from its queueing. Its loop waits for
    the CUDA stream after each item there, and does nothing more on gloo (where the collective blocks already)."""
    from megatron_qarl.sync import broadcaster

    groups = types.SimpleNamespace(world=object())
    waits = []
    stream = types.SimpleNamespace(synchronize=lambda: waits.append(1))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    for backend, expected in (("gloo", 0), ("nccl", 3)):
        waits.clear()
        monkeypatch.setattr(broadcaster.dist, "get_backend", lambda group, b=backend: b)
        pace = broadcaster._pace(groups)
        for _ in range(3):
            pace()
        assert len(waits) == expected, backend
    assert broadcaster._pace(None)() is None
