"""The weight sync: learner rank 0 pushes weights to SGLang-protocol servers, in full or as a delta.

Three rooms: sync/weight_update.py speaks SGLang's weight-update HTTP protocol, sync/transport.py holds the
weight-update group and sends sessions of buckets over it, sync/verify.py compares checksums; this module decides
what one sync sends (the delta policy below) and runs it.

One sync, in SGLang 0.5.23's order (its updates are refused outside a weight-update session):
    pause_generation (mode abort, or retract while a bounded-staleness pipeline keeps requests in flight)
    -> flush_cache -> begin_weight_update -> per bucket: POST
    /update_weights_from_distributed to every engine (names, dtypes, shapes, in order) while
    broadcasting each tensor from rank 0 in that same order -> end_weight_update (the server
    repacks its low-bit weights once) -> continue_generation; every sync carries a new weight_version (a delta
    with nothing to send names it with /update_weight_version).
A failure at any point raises SyncError naming the server(s); the sessions that were opened are
closed, and a broadcast that cannot complete (a server refused its bucket or died) is abandoned by
destroying the group on every side, so no collective stays pending; the next sync forms a new group
(sync/transport.py). Generation is continued on every server the sync paused before the error is raised (after a
successful update too: a server whose continue fails does not stop the others'), a
request retracted there (bounded staleness), or sent there meanwhile, would otherwise wait until its client's
timeout (rollout.timeout_s x retries), and the trainer's shutdown with it; the run stops on the error, so what
those requests sample after it (possibly on partly updated weights) is never trained on.

All learner ranks call `sync` (the payload is gathered collectively); only rank 0 talks to the servers. The payload's
collectives run on the sync's own groups (moe/parallelize.py ``sync_groups``), whose timeout is the longest stretch
of rank 0's I/O between two of them (sync/transport.py ``peer_wait_s``, from rollout.sync.timeout_s), not
launch.collective_timeout_s: the other ranks wait through rank 0's I/O without a collective timing out first.
Once the sessions' end is through (or rank 0 failed before it: it then finishes the payload's gathers first), rank 0
broadcasts the outcome on the sync's world group, and a failure is the same SyncError on every rank. What follows
(a delta's checksum check, continue_generation, verify) is rank 0's alone: a failure there is raised on rank 0,
after the other ranks have returned.
``verify``: every server's /weights_checker checksums (SGLang's definition, sync/checksum.py) must equal those
of what was sent -- the embedded server only (docs/rollout.md).

``delta`` (embedded servers only): after a full sync, a sync sends only the changed blocks of each
tensor (sync/delta.py, ``load_format="delta"``) over the same sessions and buckets. Rank 0 keeps a CPU
copy of what the servers hold (``delta.Baseline``). A sync is full instead, and says why in
``SyncReport.full_reason``, when (checked in this order, before the servers are paused):
  1. there is no baseline: the first sync, or the previous sync did not complete;
  2. the weight-update group is new (none yet, or destroyed after a failure);
  3. there is a version gap: the version about to be sent is not the last one sent + 1 (``version`` was
     set from outside, e.g. after a checkpoint load);
  4. a server's /get_model_info ``weight_version`` is not the version this broadcaster last completed
     on it (a restarted server reports "default"; another trainer's update, its own): the group is
     closed and formed anew before the full sync, since such a server has no (or another) group;
  5. a server computes in another dtype than the one sent (its high-precision tensors are casts, which
     the checksum check below cannot reproduce).
After a delta sync, before generation continues (``delta_check``, or ``verify``), every server's
/weights_checker checksums must equal the learner's checksums (sync/checksum.py) of the baseline, i.e. of
the full state a full sync would have left; on any disagreement the full baseline is sent at once in a
second session and checked again (a second disagreement raises SyncError).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from megatron_qarl.moe.parallelize import SyncGroups, broadcast, group_empty, sync_groups, to_group_device
from megatron_qarl.sync import delta
from megatron_qarl.sync.checksum import ChecksumAccumulator, weight_checksums
from megatron_qarl.sync.payload import iter_sync_tensors
from megatron_qarl.sync.transport import BroadcastTransport, all_at_once, peer_wait_s
from megatron_qarl.sync.verify import check_sent, disagreements
from megatron_qarl.sync.weight_update import CLEANUP_S, Engine, SyncError, WeightUpdateAPI
from megatron_qarl.wire import dtype_name

log = logging.getLogger(__name__)

OUTCOME_BYTES = 4096  # the sync's outcome as rank 0 broadcasts it: a failure's message, UTF-8, cut to this


def share_outcome(problem: str | None, groups: SyncGroups | None) -> str:
    """Collective over the sync's world group: rank 0's ``problem`` ("" or None: the sync went through), as every rank
    receives it (one broadcast of OUTCOME_BYTES, one host read). Without groups (a world of one) ``problem``."""
    if groups is None:
        return problem or ""
    if problem is not None:  # rank 0
        data = list(problem.encode()[:OUTCOME_BYTES])
        raw = torch.zeros(OUTCOME_BYTES, dtype=torch.uint8)
        raw[: len(data)] = torch.tensor(data, dtype=torch.uint8)
        buf = to_group_device(raw, groups.world)
    else:
        buf = group_empty([OUTCOME_BYTES], torch.uint8, groups.world)
    broadcast(buf, 0, groups.world, name="the weight sync's outcome")
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode(errors="ignore")


def _pace(groups: SyncGroups | None) -> Callable[[], None]:
    """What a rank other than 0 does after each of the payload's collectives. On NCCL a collective's ``wait()`` only
    orders the current CUDA stream, so without a host wait those ranks would queue every gather of the payload (and
    the outcome's broadcast) far ahead of rank 0, each op's clock running from its queueing (ProcessGroupNCCL's
    ``workStartTime_``) through many of rank 0's buckets, its buffers held meanwhile: past the peer bound
    (``transport.peer_wait_s``) the watchdog would abort them without the SyncError. Waiting for the stream after each
    one keeps them at rank 0's pace; on gloo a collective already blocks the host."""
    if groups is not None and dist.get_backend(groups.world) == "nccl":
        return torch.cuda.current_stream().synchronize
    return lambda: None


@dataclasses.dataclass
class SyncReport:
    weight_version: str
    tensors: int
    bytes: int
    buckets: int
    seconds: float
    checksums: dict[str, str] = dataclasses.field(default_factory=dict)
    mode: str = "full"  # "full", "delta", or "delta+full" (a delta, then the full state after a disagreement)
    full_reason: str = ""  # why a sync with ``delta`` on was full (empty for a delta sync)
    check_s: float = 0.0  # seconds of the checksum check after a delta (both sides' hashing + HTTP)
    blocks: dict[int, int] = dataclasses.field(default_factory=dict)  # delta: block size b -> tensors sent with it


class DistributedBroadcaster:
    """Weight sync over a torch.distributed broadcast group (one per set of engines)."""

    def __init__(self, engines: Iterable[Engine], *, master_addr: str = "127.0.0.1", master_port: int = 0,
                 backend: str | None = None, bucket_bytes: int = 512 << 20, group_name: str = "weight_update_group",
                 dtype: torch.dtype = torch.bfloat16, timeout_s: float = 300.0, verify: bool = False,
                 progress: Callable[[int, int], None] | None = None, delta: bool = False, delta_check: bool = True,
                 api_cls: type[WeightUpdateAPI] = WeightUpdateAPI, pause_mode: str = "abort"):
        self.transport = BroadcastTransport(engines, master_addr=master_addr, master_port=master_port,
                                            backend=backend, bucket_bytes=bucket_bytes, group_name=group_name,
                                            timeout_s=timeout_s, progress=progress, api_cls=api_cls)
        self.dtype, self.verify = dtype, verify
        self.pause_mode = pause_mode  # /pause_generation's mode: "retract" keeps requests alive across the sync
        self.version = 0
        self._is_sender = not dist.is_initialized() or dist.get_rank() == 0
        self.delta, self.delta_check = delta, delta_check
        self.baseline: delta.Baseline | None = None  # rank 0, delta on: what the servers hold
        self._held: dict[str, str] = {}  # engine url -> the weight_version this broadcaster last completed there
        self._last_sent = 0  # the version number of the last completed sync

    @property
    def apis(self) -> list[WeightUpdateAPI]:
        return self.transport.apis

    def connect(self) -> None:
        """Create the weight-update group with every engine (learner rank 0 only; within the current stretch)."""
        if self._is_sender:
            self.transport.connect()

    def close(self) -> None:
        """Leave the weight-update group on every side."""
        self.transport.close()

    # ------------------------------------------------------------------------------------- sync
    def sync(self, learner) -> SyncReport | None:
        """Push the learner's current weights (collective over learner ranks; rank 0 reports). A failure up to the
        sessions' end raises the same SyncError on every rank (module docstring)."""
        start = time.perf_counter()
        self.version += 1
        version = f"v{self.version}"
        report = SyncReport(version, 0, 0, 0, 0.0)
        groups = sync_groups(peer_wait_s(self.transport.timeout_s)) if dist.is_initialized() else None
        tensors = iter_sync_tensors(learner, self.dtype, groups=groups)
        if not self._is_sender:
            keep_pace = _pace(groups)
            for _ in tensors:  # the other ranks take part in the gathers only
                keep_pace()
            problem = share_outcome(None, groups)
            if problem:
                raise SyncError(problem)
            return None
        checksums = ChecksumAccumulator() if self.verify else None
        paused: list[WeightUpdateAPI] = []
        try:
            self._send(tensors, version, report, checksums, paused)
        except BaseException as err:
            problem = str(err) if isinstance(err, SyncError) else \
                f"{type(err).__name__} on learner rank 0 during the weight sync: {err}"
            try:
                for _ in tensors:  # the other learner ranks are still in the payload's gathers: finish them
                    pass
                share_outcome(problem, groups)
            except Exception as lost:  # noqa: BLE001 - a peer gone too (its gathers broken): keep rank 0's own error
                log.warning("the other learner ranks were not told of the failed sync (%s: %s)",
                            type(lost).__name__, lost)
            self._after_failure(paused)
            raise
        share_outcome("", groups)
        try:
            if report.mode == "delta":
                if not report.buckets:  # nothing changed, so no update call carried the new version: name it
                    self.transport.each(lambda api: api.update_weight_version(version))
                if self.delta_check or self.verify:
                    self._check_delta(version, report)
        except BaseException:
            self._after_failure(paused)
            raise
        self._continue_all()
        self._held = {api.url: version for api in self.apis}
        self._last_sent = self.version
        if checksums is not None and report.mode == "full":  # a delta was checked against the full state above
            report.checksums = checksums.result()
            check_sent(self.apis, report.checksums)
        report.seconds = time.perf_counter() - start
        return report

    def _send(self, tensors, version: str, report: SyncReport, checksums: ChecksumAccumulator | None,
              paused: list[WeightUpdateAPI]) -> None:
        """Rank 0's I/O up to the sessions' end: the preamble in one stretch (why full, the group, pause and flush),
        then the session's start, buckets and end (sync/transport.py, a stretch each)."""
        transport = self.transport
        with transport.stretch():
            report.full_reason = self._full_sync_reason() if self.delta else ""
            self.connect()
            paused.extend(self.apis)  # before the calls: a pause that fails half-way may still hold requests
            for api in self.apis:
                api.pause_generation(self.pause_mode)
                api.flush_cache()
        if not self.delta or report.full_reason:
            stream = self._record(tensors) if self.delta else tensors
            transport.session(([item] for item in stream), version, report, checksums, None)
        else:
            report.mode = "delta"
            deltas = self.baseline.encode(tensors)
            transport.session((d.wire() for d in deltas), version, report, None, delta.LOAD_FORMAT)
            report.blocks = dict(self.baseline.blocks)

    def _after_failure(self, paused: list[WeightUpdateAPI]) -> None:
        """A failed sync on rank 0: the next one is full (the servers may hold part of this one), the sessions
        still open are ended and the paused servers continued (each all at once, CLEANUP_S): requests parked there
        would wait otherwise."""
        self.baseline = None
        self.transport.abandon()
        all_at_once(paused, WeightUpdateAPI.quietly_continue, CLEANUP_S)

    def _continue_all(self) -> None:
        """``continue_generation`` on every server, then SyncError naming each that failed: one server's failure
        must not leave the servers after it paused (a request retracted there would wait out its client's
        timeout, rollout.timeout_s x retries, and the trainer's shutdown with it)."""
        failed = []
        for api in self.apis:
            try:
                with self.transport.stretch():  # each server its own rollout.sync.timeout_s
                    api.continue_generation()
            except SyncError as err:
                failed.append(str(err))
        if failed:
            raise SyncError("continue_generation after the weight update failed on " + "; ".join(failed))

    # ------------------------------------------------------------------------------ delta policy
    def _record(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """A full sync with delta on: the baseline keeps a copy of every tensor sent."""
        self.baseline = delta.Baseline()
        return self.baseline.record(tensors)

    def _full_sync_reason(self) -> str:
        """Why this sync must be full (empty: a delta is sound); the checks of the module docstring."""
        if self.baseline is None:
            return "no baseline: the first sync, or the last one did not complete"
        if self.transport.group is None:
            return "a new weight-update group"
        if self.version != self._last_sent + 1:
            return f"version gap: the last sync sent v{self._last_sent}, this one is v{self.version}"
        for api in self.apis:
            info = api.model_info()
            held, sent = info.get("weight_version"), self._held.get(api.url)
            if held != sent:
                self.close()  # a restarted server has no group, another trainer's has its own
                return (f"{api.url} holds weight_version {held!r}, not {sent!r} sent last (restarted, or "
                        "updated by another client)")
            if info.get("dtype") != dtype_name(self.dtype):
                return (f"{api.url} computes in {info.get('dtype')}, the sync sends {dtype_name(self.dtype)}: "
                        "its held high-precision tensors are casts the checksum check cannot reproduce")
        return ""

    def _check_delta(self, version: str, report: SyncReport) -> None:
        """Every server's checksums must equal those of the learner's full state (the baseline); else the
        full state is sent now, in a second session, and must then agree (SyncError otherwise)."""
        t0 = time.perf_counter()
        expected = weight_checksums(self.baseline.tensors)
        wrong = disagreements(self.apis, expected)
        if wrong:
            report.mode, report.full_reason = "delta+full", f"checksum disagreement after the delta: {wrong}"
            self.transport.session(([item] for item in self.baseline.tensors.items()), version, report, None, None)
            wrong = disagreements(self.apis, expected)
            if wrong:
                raise SyncError(f"checksums still differ after a full sync: {wrong}")
        report.checksums = expected
        report.check_s = time.perf_counter() - t0
