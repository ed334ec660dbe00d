"""Device-true collectives: every tensor the package hands to a collective, a broadcast or a server is on its process
group's device, placed there by the one helper (megatron_qarl/moe/parallelize.py), and no other module calls
torch.distributed's collectives.

NCCL refuses CPU tensors (even in a group of one), and a CPU-only machine has no second device to get wrong. So the
suite runs in strict mode (tests/conftest.py sets QARL_STRICT_DEVICES=1, inherited by spawned ranks and server
processes): the wrappers refuse any tensor that ``to_group_device`` / ``group_empty`` did not place. The tests that
drive the real paths (tests/test_sync_payload.py, test_sync_server.py, test_sync_delta_server.py, test_learner.py,
test_qat_megatron.py) therefore pass only if every tensor on the way was placed; the tests below show what
the old code (``weight_shape`` made by ``torch.tensor(...)`` on the CPU and handed on as it was) now meets.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_qarl.moe import parallelize
from megatron_qarl.moe.parallelize import (
    DeviceError,
    all_gather_tensors,
    all_reduce,
    broadcast,
    group_device,
    group_empty,
    to_group_device,
)

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_qarl"
DEVICE_HELPER = PACKAGE / "moe" / "parallelize.py"
# Code that runs inside vLLM's own workers and environment (torch + vllm, never megatron_qarl, so it cannot call the
# helper): it places its receive buffers itself, on the group's device (QarlWeightTransferEngine.group_is_nccl).
OUTSIDE_THE_PACKAGE_ENV = PACKAGE / "rollout" / "vllm_ext"
# preflight's probe receives a bucket the way a server does, inside the servers' environment (which may lack
# megatron-core, which the helper imports): it places its buffers on the group's device itself
SERVER_SIDE_PROBE = PACKAGE / "preflight" / "probe.py"
# torch.distributed's collectives and point-to-point calls
COLLECTIVES = {
    "broadcast", "broadcast_object_list", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "monitored_barrier",
}


def _direct_collective_calls(path: Path, root: Path = REPO) -> list[str]:
    """'file:line name' for every use of a torch.distributed collective in a module (any import spelling)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = set()  # names bound to the torch.distributed module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            if node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
                found += [f"{path.relative_to(root)}:{node.lineno} {a.name}" for a in node.names
                          if a.name in COLLECTIVES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = node.value
            if ((isinstance(base, ast.Name) and base.id in aliases)
                    or (isinstance(base, ast.Attribute) and base.attr == "distributed"
                        and isinstance(base.value, ast.Name) and base.value.id == "torch")
                    or (isinstance(base, ast.Name) and base.id == "c10d")):
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.attr}")
    return found


def test_no_module_but_the_device_helper_calls_torch_distributed_collectives():
    calls = [c for p in sorted(PACKAGE.rglob("*.py"))
             if p not in (DEVICE_HELPER, SERVER_SIDE_PROBE) and OUTSIDE_THE_PACKAGE_ENV not in p.parents
             for c in _direct_collective_calls(p)]
    assert not calls, f"call the wrappers in megatron_qarl/moe/parallelize.py instead: {calls}"


def test_the_static_check_sees_every_spelling(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nimport torch.distributed as dist\nfrom torch import distributed as D\n"
                   "from torch.distributed import all_reduce\n"
                   "def f(t):\n    dist.broadcast(t, 0)\n    torch.distributed.all_gather([t], t)\n"
                   "    D.barrier()\n    all_reduce(t)\n    dist.get_rank()\n")
    calls = _direct_collective_calls(src, tmp_path)
    assert sorted(c.split()[1] for c in calls) == ["all_gather", "all_reduce", "barrier", "broadcast"]


@pytest.fixture
def gloo_group():
    """A gloo group of one that is not the default group (as the weight-update group is)."""
    from megatron_qarl.wire import destroy_process_group, init_custom_process_group

    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{parallelize.free_port()}", 1, 0, "device_test")
    yield pg
    destroy_process_group(pg)


def test_group_device_is_cpu_for_gloo_and_the_current_gpu_for_nccl(gloo_group, monkeypatch):
    assert group_device(gloo_group) == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert group_device(gloo_group) == torch.device("cuda", 3)


def test_strict_mode_is_on_in_the_suite():
    assert parallelize.strict_devices(), "tests/conftest.py sets QARL_STRICT_DEVICES=1"


def test_the_old_cpu_weight_shape_is_refused_by_every_collective(gloo_group):
    """qat/export.py used to make weight_shape with torch.tensor(qw.shape, dtype=torch.int32), on the CPU, and the
    payload all-gathered it over the EP group and the broadcaster broadcast it: refused here, naming it, although
    a gloo group would have taken it, as strict mode asks that every tensor be placed by the one helper."""
    old_weight_shape = torch.tensor((96, 64), dtype=torch.int32)
    name = "model.layers.0.mlp.experts.0.up_proj.weight_shape"
    with pytest.raises(DeviceError, match=r"experts\.0\.up_proj\.weight_shape: a torch\.int32 \[2\] tensor on cpu "
                                          r"handed to a collective was not placed by parallelize\.to_group_device"):
        all_gather_tensors(old_weight_shape, gloo_group, 1, name=name)
    with pytest.raises(DeviceError, match="weight_shape"):
        broadcast(old_weight_shape, 0, gloo_group, name=name)
    with pytest.raises(DeviceError, match="loss"):
        all_reduce(torch.zeros(1), gloo_group, name="loss")
    placed = to_group_device(old_weight_shape, gloo_group)
    assert all_gather_tensors(placed, gloo_group, 1, name=name)[0] is placed
    broadcast(placed, 0, gloo_group, name=name)
    buffer = group_empty([2], torch.int32, gloo_group)
    broadcast(buffer, 0, gloo_group, name=name)
    parallelize.barrier(gloo_group)  # a barrier carries no tensor; NCCL's is given the group's device


def test_without_strict_mode_only_the_device_is_checked(gloo_group, monkeypatch):
    """Outside the suite (strict off) a CPU tensor passes a gloo group; one on another device is refused, naming
    the group's device (what a CPU tensor meets at an NCCL group on a GPU machine)."""
    monkeypatch.delenv(parallelize.STRICT_ENV)
    assert all_gather_tensors(torch.ones(2), gloo_group, 1)[0].device.type == "cpu"
    with pytest.raises(DeviceError, match=r"codes: a meta tensor handed to a collective of a gloo group, whose "
                                          r"tensors live on cpu"):
        broadcast(torch.empty(2, device="meta"), 0, gloo_group, name="codes")


def test_a_placed_mark_belongs_to_the_tensor_not_to_its_id(gloo_group):
    placed = to_group_device(torch.ones(3), gloo_group)
    copy = placed.clone()  # same device, never placed
    with pytest.raises(DeviceError, match="not placed"):
        broadcast(copy, 0, gloo_group, name="copy")
    key = id(placed)
    del placed  # the mark goes with the tensor: a later tensor that reuses its id is not marked
    assert key not in parallelize._PLACED


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8_fp8", "w8a8_int8"])
def test_every_exported_tensor_is_on_the_device_of_its_codes(scheme):
    """to_sglang_tensors creates nothing on a device of its own: with codes on the meta device (a device a CPU
    machine has besides the CPU) every tensor it returns is on meta; the old weight_shape was on the CPU.
    pack_int4 packs on meta too: it reads nothing to the host (issue 48; it read the codes' range per tensor)."""
    from megatron_qarl.qat import export
    from megatron_qarl.qat.quantizer import QuantizedWeight

    n, k = 16, 32
    codes = {"w4a16": torch.int8, "w8a8_fp8": torch.float8_e4m3fn, "w8a8_int8": torch.int8}[scheme]
    scales = {"w4a16": (n, 1), "w8a8_fp8": (1, 1), "w8a8_int8": (n, 1)}[scheme]
    zeros = torch.empty((n, 1), dtype=torch.int8, device="meta") if scheme == "w4a16" else None
    qw = QuantizedWeight(torch.empty((n, k), dtype=codes, device="meta"),
                         torch.empty(scales, dtype=torch.float32, device="meta"), zeros, (n, k), scheme, 32)
    out = export.to_sglang_tensors("model.layers.0.mlp.experts.0.up_proj", qw)
    off_device = {name: str(t.device) for name, t in out.items() if t.device.type != "meta"}
    assert out and not off_device, f"made off the codes' device (meta): {off_device}"


def _payload_without_placement(model_dir: str) -> None:
    """The sync payload with the old hand-over: its expert tensors go to the EP all-gather as they come."""
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Learner
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import init_parallel
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.sync.payload import iter_sync_tensors

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel()
    learner = Learner(arch, ParallelConfig(), OptimConfig(), quant=QuantConfig(scheme="w4a16"))
    for _ in iter_sync_tensors(learner):
        pass


def test_the_real_payload_refuses_a_tensor_it_did_not_place(random_model_dir, monkeypatch):
    """The payload path as it runs (one rank, in this process): take the placement out of sync/payload.py and the
    first expert tensor of the quantized payload is refused, naming it; with it, tests/test_sync_payload.py passes."""
    from megatron_qarl.sync import payload

    monkeypatch.setattr(payload, "to_group_device", lambda t, group=None: t)
    with pytest.raises(DeviceError, match=r"model\.layers\.0\.mlp\.experts\.0\.\w+_proj\.weight_packed: .* was not "
                                          r"placed by parallelize\.to_group_device"):
        parallelize.run_ranks(1, _payload_without_placement, random_model_dir)


def _rank_sees() -> tuple:
    import os

    import megatron_qarl.learner.rank  # noqa: F401 - preloaded by the forkserver: must be importable, and cheap here

    return os.environ.get("QARL_TEST_MARK"), os.getcwd(), os.environ["RANK"], torch.get_num_threads()


@pytest.mark.multiproc
def test_ranks_see_the_callers_environment_and_directory(tmp_path, monkeypatch):
    """run_ranks forks ranks from a forkserver started once (CPU machines): a rank must still see the environment and
    working directory of the call, not the forkserver's from when it started."""
    parallelize.run_ranks(2, _rank_sees)  # the forkserver now runs, started with the old environment
    monkeypatch.setenv("QARL_TEST_MARK", "set-after-the-forkserver-started")
    monkeypatch.chdir(tmp_path)
    got = parallelize.run_ranks(2, _rank_sees)
    assert [g[:3] for g in got] == [("set-after-the-forkserver-started", str(tmp_path), str(r)) for r in range(2)]
    assert parallelize.rank_context().get_start_method() == ("spawn" if torch.cuda.is_available() else "forkserver")


def _float8_broadcast() -> bool:
    """Rank 0 broadcasts FP8 codes over the default (gloo) group; rank 1 receives them into a float8 buffer."""
    dist.init_process_group("gloo")
    codes = torch.linspace(-448, 448, 64).to(torch.float8_e4m3fn)
    buffer = to_group_device(codes) if dist.get_rank() == 0 else group_empty([64], torch.float8_e4m3fn)
    broadcast(buffer, 0, name="model.layers.0.self_attn.q_proj.weight")
    return buffer.dtype == torch.float8_e4m3fn and torch.equal(buffer.view(torch.uint8), codes.view(torch.uint8))


@pytest.mark.multiproc
def test_float8_codes_cross_a_gloo_group_bit_for_bit():
    """gloo has no float8 type: main before issue 29 raised "Invalid scalar type" at the first weight sync of every
    w8a8_fp8 run with the embedded server (found by tests/test_combinations.py's runs)."""
    assert parallelize.run_ranks(2, _float8_broadcast) == [True, True]


def _half_an_answer_then_death() -> str:
    """Rank 1 writes the header of a 1 MiB message and 3 of its bytes on every pipe it may answer on, then dies."""
    import gc
    import os
    from multiprocessing.connection import Connection

    if int(os.environ["RANK"]) == 1:
        for conn in [o for o in gc.get_objects() if isinstance(o, Connection)]:
            if conn.writable and not conn.readable and not conn.closed:
                os.write(conn.fileno(), (1 << 20).to_bytes(4, "big") + b"abc")
        os._exit(3)
    return "rank 0's answer"


def _run_two_ranks_that_die_mid_answer() -> str:
    try:
        parallelize.run_ranks(2, _half_an_answer_then_death, timeout=60)
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.multiproc
def test_a_rank_that_dies_half_way_through_its_answer_is_named_not_waited_for():
    """Issue 53 item 5: run_ranks read every rank's answer from one shared queue, whose pipe this process also held
    open for writing, so a rank that died after the first bytes of its answer left ``queue.get()`` waiting for the
    rest, forever (no end of file; past run_ranks' own timeout too). Now each rank answers on its own pipe: its death
    is an end of file, named."""
    from bounded_child import run_in_child

    message = run_in_child(_run_two_ranks_that_die_mid_answer, timeout_s=90, name="run_ranks, rank 1 dies")
    assert "rank 1: exited (code 3) without a result" in message, message


def _group_timeouts(timeout_s: float) -> dict[str, float]:
    """Every process group Megatron created (and the default group), as its backend holds its timeout."""
    from megatron.core import parallel_state as ps

    parallelize.init_parallel(timeout_s=timeout_s)
    out = {}
    for group in ps._global_process_group_list:
        pg = group or dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cpu"))
        out[pg.group_desc or pg.group_name] = backend.options._timeout.total_seconds()
    return out


def test_every_learner_group_waits_exactly_collective_timeout_s():
    """Issue 53 item 5: Megatron's groups took launch.collective_timeout_s rounded up to whole minutes, and its
    expert-data-parallel gloo group none at all (gloo's 30 minutes: ``create_group`` without ``timeout``)."""
    timeouts = parallelize.run_ranks(1, _group_timeouts, 7.5)[0]
    assert "EXPERT_DATA_PARALLEL_GROUP_GLOO" in timeouts and len(timeouts) > 10, timeouts
    assert set(timeouts.values()) == {7.5}, timeouts


def _checkpoint_bound_timeouts() -> tuple[set, set, set]:
    """Every learner group's timeout before, inside and after ``collective_timeout`` (a checkpoint's bound)."""
    from megatron_qarl.learner.worker import LearnerWorker

    def timeouts():
        return {g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for g in parallelize.learner_groups()}

    from megatron_qarl.preflight.rules import load_config

    cfg = load_config(REPO / "configs" / "cpu_default.yaml",
                      ["launch.collective_timeout_s=7.5", "launch.checkpoint_timeout_s=99"])
    parallelize.init_parallel(timeout_s=cfg.launch.collective_timeout_s)  # as LearnerWorker.setup does
    worker = LearnerWorker(cfg, 0, 1)
    before = timeouts()
    with worker._checkpoint_bound():
        inside = timeouts()
    return before, inside, timeouts()


def test_a_checkpoint_waits_its_own_bound_and_the_collectives_theirs_after():
    """Issue 53 item 1: dist-checkpointing's save and load and save_learner's barriers ran on the learner's groups
    under launch.collective_timeout_s, so a rank that finished writing its shards more than that before the slowest
    timed out. Now every learner group waits launch.checkpoint_timeout_s while a checkpoint is saved or loaded."""
    before, inside, after = parallelize.run_ranks(1, _checkpoint_bound_timeouts)[0]
    assert (before, inside, after) == ({7.5}, {99.0}, {7.5})
