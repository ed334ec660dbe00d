"""The distributed-broadcast transport: learner rank 0 pushes weights to SGLang-protocol servers.

One sync, in SGLang 0.5.23's order (its updates are refused outside a weight-update session):
    pause_generation -> flush_cache -> begin_weight_update -> per bucket: POST
    /update_weights_from_distributed to every engine (names, dtypes, shapes, in order) while
    broadcasting each tensor from rank 0 in that same order -> end_weight_update (the server
    repacks its low-bit weights once) -> continue_generation; every sync carries a new weight_version (a delta
    with nothing to send names it with /update_weight_version).
A failure at any point raises SyncError naming the server(s); the sessions that were opened are
closed, and a broadcast that cannot complete (a server refused its bucket or died) is abandoned by
destroying the group on every side, so no collective stays pending; the next sync forms a new group.
The weight-update group is the one SGLang expects: the trainer is rank 0, engine i joins with
rank_offset = 1 + the ranks of the engines before it, world_size = 1 + all engine ranks; gloo on
CPU, NCCL on GPUs. All learner ranks call `sync` (the payload is gathered collectively); only rank 0
talks to the servers. ``verify``: every server's /weights_checker checksums (SGLang's definition,
sync/checksum.py) must equal those of what was sent -- the embedded server only (docs/rollout.md).

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
import threading
import time
from collections.abc import Callable, Iterable

import httpx
import torch
import torch.distributed as dist

from megatron_qarl.moe.parallelize import broadcast, to_group_device
from megatron_qarl.sync import delta
from megatron_qarl.sync.checksum import ChecksumAccumulator, weight_checksums
from megatron_qarl.sync.payload import iter_sync_tensors
from megatron_qarl.wire import dtype_name, response_body


class SyncError(RuntimeError):
    """A weight sync failed; the message names the server."""


@dataclasses.dataclass(frozen=True)
class Engine:
    url: str  # http://host:port
    ranks: int = 1  # the engine's tensor-parallel ranks in the weight group
    api_key: str | None = None


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
                 progress: Callable[[int, int], None] | None = None, delta: bool = False, delta_check: bool = True):
        from megatron_qarl.moe.parallelize import dist_backend, free_port

        self.engines = list(engines)
        self.master_addr, self.master_port = master_addr, master_port or free_port()
        self._auto_port = not master_port  # a group formed anew takes a fresh port
        self.backend = backend or dist_backend()
        self.bucket_bytes, self.group_name, self.dtype = bucket_bytes, group_name, dtype
        self.timeout_s, self.verify = timeout_s, verify
        self.progress = progress  # called as progress(buckets_sent, bytes_sent) after every bucket
        self.group = None
        self.version = 0
        self._is_sender = not dist.is_initialized() or dist.get_rank() == 0
        self.delta, self.delta_check = delta, delta_check
        self.baseline: delta.Baseline | None = None  # rank 0, delta on: what the servers hold
        self._held: dict[str, str] = {}  # engine url -> the weight_version this broadcaster last completed there
        self._last_sent = 0  # the version number of the last completed sync

    # --------------------------------------------------------------------------------------- HTTP
    def _post(self, engine: Engine, path: str, payload: dict | None = None) -> dict:
        return self._call("POST", engine, path, payload or {})

    def _get(self, engine: Engine, path: str) -> dict:
        return self._call("GET", engine, path, None)

    def _call(self, method: str, engine: Engine, path: str, payload: dict | None) -> dict:
        """One HTTP call; a transport error or a 4xx/5xx is a SyncError naming the server and the endpoint."""
        headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
        try:
            if method == "POST":
                r = httpx.post(engine.url + path, json=payload, headers=headers, timeout=self.timeout_s)
            else:
                r = httpx.get(engine.url + path, headers=headers, timeout=self.timeout_s)
        except httpx.HTTPError as err:
            raise SyncError(f"{engine.url}{path}: {type(err).__name__}: {err}") from None
        if r.status_code >= 400:
            raise SyncError(f"{engine.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        body = response_body(r)
        return body if isinstance(body, dict) else {"text": body}

    def _start_all(self, path: str, payloads: list[dict]) -> _Calls:
        """POST to every engine concurrently; the calls block server-side until the broadcasts end."""
        calls = _Calls(self, path, payloads)
        calls.start()
        return calls

    # ------------------------------------------------------------------------------------ group
    def connect(self) -> None:
        """Create the weight-update group with every engine (learner rank 0 only)."""
        if not self._is_sender or self.group is not None:
            return
        from megatron_qarl.wire import init_custom_process_group

        for engine in self.engines:  # fail fast, naming the server, rather than wait for a group that never forms
            try:
                httpx.get(engine.url + "/health", timeout=10.0).raise_for_status()
            except httpx.HTTPError as err:
                raise SyncError(f"{engine.url}/health: {type(err).__name__}: {err}") from None
        world = 1 + sum(e.ranks for e in self.engines)
        offsets = [1 + sum(e.ranks for e in self.engines[:i]) for i in range(len(self.engines))]
        calls = self._start_all("/init_weights_update_group", [
            {"master_address": self.master_addr, "master_port": self.master_port, "rank_offset": off,
             "world_size": world, "group_name": self.group_name, "backend": self.backend} for off in offsets])
        self.group = init_custom_process_group(
            backend=self.backend, init_method=f"tcp://{self.master_addr}:{self.master_port}", world_size=world,
            rank=0, group_name=self.group_name)
        calls.join()

    def close(self) -> None:
        """Leave the weight-update group on every side (servers first: a peer blocked in a broadcast
        on it is released when the other side destroys it)."""
        if self.group is None:
            return
        threads = [threading.Thread(target=self._quietly, args=(e, "/destroy_weights_update_group",
                                                                {"group_name": self.group_name}), daemon=True)
                   for e in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30.0)
        try:
            dist.destroy_process_group(self.group)
        except Exception:  # noqa: BLE001 - a group broken by a dead peer may refuse a clean shutdown
            pass
        self.group = None
        if self._auto_port:
            from megatron_qarl.moe.parallelize import free_port

            self.master_port = free_port()

    def _quietly(self, engine: Engine, path: str, payload: dict) -> None:
        """Best-effort cleanup call: a dead or refusing server has nothing to clean up."""
        try:
            self._post(engine, path, payload)
        except SyncError:
            pass

    # ------------------------------------------------------------------------------------- sync
    def sync(self, learner) -> SyncReport | None:
        """Push the learner's current weights (collective over learner ranks; rank 0 reports)."""
        start = time.perf_counter()
        self.version += 1
        version = f"v{self.version}"
        report = SyncReport(version, 0, 0, 0, 0.0)
        tensors = iter_sync_tensors(learner, self.dtype)
        if not self._is_sender:
            for _ in tensors:  # the other ranks take part in the gathers only
                pass
            return None
        checksums = ChecksumAccumulator() if self.verify else None
        try:
            report.full_reason = self._full_sync_reason() if self.delta else ""
            self.connect()
            for engine in self.engines:
                self._post(engine, "/pause_generation", {})
                self._flush(engine)
            if not self.delta or report.full_reason:
                stream = self._record(tensors) if self.delta else tensors
                self._session(([item] for item in stream), version, report, checksums, None)
            else:
                report.mode = "delta"
                deltas = self.baseline.encode(tensors)
                self._session((d.wire() for d in deltas), version, report, None, delta.LOAD_FORMAT)
                if not report.buckets:  # nothing changed, so no update call carried the new version: name it
                    for engine in self.engines:
                        self._post(engine, "/update_weight_version", {"new_version": version,
                                                                      "abort_all_requests": False})
                report.blocks = dict(self.baseline.blocks)
                if self.delta_check or self.verify:
                    self._check_delta(version, report)
        except BaseException:
            for _ in tensors:  # the other learner ranks are still in the payload's gathers: finish them
                pass
            self.baseline = None  # the servers may hold part of this sync: the next one is full
            raise
        for engine in self.engines:
            self._post(engine, "/continue_generation", {})
        self._held = {engine.url: version for engine in self.engines}
        self._last_sent = self.version
        if checksums is not None and report.mode == "full":  # a delta was checked against the full state above
            report.checksums = checksums.result()
            self._verify(report)
        report.seconds = time.perf_counter() - start
        return report

    def _record(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """A full sync with delta on: the baseline keeps a copy of every tensor sent."""
        self.baseline = delta.Baseline()
        return self.baseline.record(tensors)

    def _full_sync_reason(self) -> str:
        """Why this sync must be full (empty: a delta is sound); the checks of the module docstring."""
        if self.baseline is None:
            return "no baseline: the first sync, or the last one did not complete"
        if self.group is None:
            return "a new weight-update group"
        if self.version != self._last_sent + 1:
            return f"version gap: the last sync sent v{self._last_sent}, this one is v{self.version}"
        for engine in self.engines:
            info = self._get(engine, "/get_model_info")
            held, sent = info.get("weight_version"), self._held.get(engine.url)
            if held != sent:
                self.close()  # a restarted server has no group, another trainer's has its own
                return (f"{engine.url} holds weight_version {held!r}, not {sent!r} sent last (restarted, or "
                        "updated by another client)")
            if info.get("dtype") != dtype_name(self.dtype):
                return (f"{engine.url} computes in {info.get('dtype')}, the sync sends {dtype_name(self.dtype)}: "
                        "its held high-precision tensors are casts the checksum check cannot reproduce")
        return ""

    def _session(self, items: Iterable[list[tuple[str, torch.Tensor]]], version: str, report: SyncReport,
                 checksums: ChecksumAccumulator | None, load_format: str | None) -> None:
        """begin_weight_update -> buckets -> end_weight_update on every engine. ``items``: groups of tensors
        that must share a bucket (a delta's index and values); a bucket closes once past ``bucket_bytes``."""
        opened: list[Engine] = []
        try:
            for engine in self.engines:
                self._post(engine, "/begin_weight_update", {})
                opened.append(engine)
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for item in items:
                for name, tensor in item:
                    bucket.append((name, tensor.contiguous()))
                    size += tensor.numel() * tensor.element_size()
                if size >= self.bucket_bytes:
                    self._send(bucket, version, report, checksums, load_format)
                    bucket, size = [], 0
            if bucket:
                self._send(bucket, version, report, checksums, load_format)
            while opened:
                self._post(opened[0], "/end_weight_update", {})
                opened.pop(0)
        except BaseException:
            for engine in opened:  # close the sessions still open (the server finalizes what it has)
                self._quietly(engine, "/end_weight_update", {})
            raise

    def _check_delta(self, version: str, report: SyncReport) -> None:
        """Every server's checksums must equal those of the learner's full state (the baseline); else the
        full state is sent now, in a second session, and must then agree (SyncError otherwise)."""
        t0 = time.perf_counter()
        expected = weight_checksums(self.baseline.tensors)
        wrong = self._disagreements(expected)
        if wrong:
            report.mode, report.full_reason = "delta+full", f"checksum disagreement after the delta: {wrong}"
            self._session(([item] for item in self.baseline.tensors.items()), version, report, None, None)
            wrong = self._disagreements(expected)
            if wrong:
                raise SyncError(f"checksums still differ after a full sync: {wrong}")
        report.checksums = expected
        report.check_s = time.perf_counter() - t0

    def _held_checksums(self, engine: Engine) -> dict[str, str]:
        """name -> checksum of every tensor the server holds (/weights_checker, all its ranks)."""
        body = self._post(engine, "/weights_checker", {"action": "checksum"})
        held: dict[str, str] = {}
        for rank in body.get("ranks") or []:
            held.update(rank.get("checksums", {}))
        return held

    def _disagreements(self, expected: dict[str, str]) -> str:
        """'' when every server holds exactly ``expected``; else which servers and tensors differ."""
        problems = []
        for engine in self.engines:
            held = self._held_checksums(engine)
            wrong = sorted(n for n in set(expected) | set(held) if held.get(n) != expected.get(n))
            if wrong:
                problems.append(f"{engine.url}: {len(wrong)} tensors differ, e.g. {wrong[:3]}")
        return "; ".join(problems)

    def _flush(self, engine: Engine, tries: int = 50) -> None:
        for _ in range(tries):  # 400 while requests are still pending: retry, as trainers do
            try:
                self._post(engine, "/flush_cache")
                return
            except SyncError as err:
                if "HTTP 400" not in str(err):
                    raise
                time.sleep(0.1)
        raise SyncError(f"{engine.url}/flush_cache: still busy after {tries} tries")

    def _send(self, bucket: list[tuple[str, torch.Tensor]], version: str, report: SyncReport,
              checksums: ChecksumAccumulator | None, load_format: str | None = None) -> None:
        """One bucket: the update calls go out, then the broadcasts. A server that answers before the
        broadcasts are through (it refused, or died) means they can never complete: the group is
        destroyed on every side, which ends them, and the error names the server. Every tensor goes on the group's
        device first (the payload's are on the learner's device; a delta's and the baseline's on the CPU)."""
        bucket = [(name, to_group_device(tensor, self.group)) for name, tensor in bucket]
        payload = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                   "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                   "flush_cache": True, "weight_version": version}
        if load_format is not None:
            payload["load_format"] = load_format
        calls = self._start_all("/update_weights_from_distributed", [payload] * len(self.engines))
        works = [broadcast(tensor, 0, self.group, async_op=True, name=name) for name, tensor in bucket]
        try:
            while not all(w.is_completed() for w in works):
                early = calls.failed()
                if early:
                    raise SyncError(f"broadcast of a bucket of {len(bucket)} tensors abandoned: {'; '.join(early)}")
                time.sleep(0.002)
            for w in works:
                w.wait()
        except Exception as err:
            self.close()  # ends the pending broadcasts on both sides
            if isinstance(err, SyncError):
                raise
            calls.join(timeout=5.0, cause=err)  # a peer died mid-broadcast: name the servers that did not answer
            raise SyncError(f"broadcast of a bucket of {len(bucket)} tensors failed: {err}") from err
        calls.join()
        for name, tensor in bucket:
            report.bytes += tensor.numel() * tensor.element_size()
            report.tensors += 1
            if checksums is not None:
                checksums.add(name, tensor)
        report.buckets += 1
        if self.progress is not None:
            self.progress(report.buckets, report.bytes)

    def _verify(self, report: SyncReport) -> None:
        """Each server's SGLang checksums of what it holds (/weights_checker) must equal those sent."""
        for engine in self.engines:
            held = self._held_checksums(engine)
            missing = [n for n in report.checksums if n not in held]
            if missing:
                raise SyncError(f"{engine.url}/weights_checker: {len(missing)} sent tensors are not among the "
                                f"server's, e.g. {missing[:3]} (a real SGLang server hashes its own fused "
                                "parameters: verification is for the embedded server)")
            wrong = [n for n, h in report.checksums.items() if held[n] != h]
            if wrong:
                raise SyncError(f"{engine.url}: {len(wrong)} tensors differ after sync, e.g. {wrong[:3]}")


class _Calls:
    """Concurrent POSTs to all engines, joined after the broadcasts."""

    def __init__(self, owner: DistributedBroadcaster, path: str, payloads: list[dict]):
        self.owner, self.path = owner, path
        self.results: list = [None] * len(owner.engines)
        self.threads = [threading.Thread(target=self._call, args=(i, e, p), daemon=True)
                        for i, (e, p) in enumerate(zip(owner.engines, payloads, strict=True))]

    def _call(self, i: int, engine: Engine, payload: dict) -> None:
        try:
            self.results[i] = self.owner._post(engine, self.path, payload)
        except SyncError as err:
            self.results[i] = err

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def failed(self) -> list[str]:
        """The problems of the calls that have already answered with a failure (non-blocking)."""
        out = []
        for engine, result in zip(self.owner.engines, self.results, strict=True):
            if isinstance(result, SyncError):
                out.append(str(result))
            elif isinstance(result, dict) and result.get("success") is False:
                out.append(f"{engine.url}{self.path}: refused: {result.get('message')}")
        return out

    def join(self, timeout: float | None = None, cause: BaseException | None = None) -> list[dict]:
        for t in self.threads:
            t.join(timeout if timeout is not None else self.owner.timeout_s)
        problems = []
        for engine, result in zip(self.owner.engines, self.results, strict=True):
            if isinstance(result, SyncError):
                problems.append(str(result))
            elif result is None:
                problems.append(f"{engine.url}{self.path}: no answer")
            elif result.get("success") is False:
                problems.append(f"{engine.url}{self.path}: refused: {result.get('message')}")
        if problems:
            raise SyncError("; ".join(problems)) from cause
        return self.results
