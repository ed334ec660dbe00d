"""The weight-update group and the bucketed broadcast over it (learner rank 0's side).

The group is the one SGLang expects: the trainer is rank 0, engine i joins with rank_offset = 1 + the ranks of
the engines before it, world_size = 1 + all engine ranks; gloo on CPU, NCCL on GPUs. One session is
begin_weight_update -> per bucket: POST /update_weights_from_distributed to every engine (names, dtypes, shapes, in
order) while broadcasting each tensor from rank 0 in that same order -> end_weight_update. A bucket closes once it
holds ``bucket_bytes``. A broadcast that cannot complete (a server refused its bucket or died) is abandoned by
destroying the group on every side, so no collective stays pending; the next ``connect`` forms a new group.
The HTTP requests are sync/weight_update.py's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from megatron_qarl import wire
from megatron_qarl.moe.parallelize import broadcast, dist_backend, free_port, to_group_device
from megatron_qarl.sync.checksum import ChecksumAccumulator
from megatron_qarl.sync.weight_update import Engine, SyncError, WeightUpdateAPI
from megatron_qarl.wire import dtype_name, init_custom_process_group


class BroadcastTransport:
    """The weight-update group with a set of engines, and the sessions and buckets sent over it."""

    def __init__(self, engines: Iterable[Engine], *, master_addr: str = "127.0.0.1", master_port: int = 0,
                 backend: str | None = None, bucket_bytes: int = 512 << 20, group_name: str = "weight_update_group",
                 timeout_s: float = 300.0, progress: Callable[[int, int], None] | None = None,
                 api_cls: type[WeightUpdateAPI] = WeightUpdateAPI):
        self.engines = list(engines)
        # api_cls: the engines' HTTP protocol (SGLang's, or vLLM's under the same method names:
        # sync/vllm_weight_update.py)
        self.apis = [api_cls(e, timeout_s) for e in self.engines]
        self.master_addr, self.master_port = master_addr, master_port or free_port()
        self._auto_port = not master_port  # a group formed anew takes a fresh port
        self.backend = backend or dist_backend()
        self.bucket_bytes, self.group_name, self.timeout_s = bucket_bytes, group_name, timeout_s
        self.progress = progress  # called as progress(buckets_sent, bytes_sent) after every bucket
        self.group = None

    def each(self, method: Callable[[WeightUpdateAPI], object]) -> None:
        """Call ``method(api)`` on every engine in turn (pause, flush, continue, ...)."""
        for api in self.apis:
            method(api)

    # ------------------------------------------------------------------------------------ group
    def connect(self) -> None:
        """Form the weight-update group with every engine (no-op while one exists)."""
        if self.group is not None:
            return
        self.each(WeightUpdateAPI.health)  # fail fast, naming the server, rather than wait for a group never formed
        world = 1 + sum(e.ranks for e in self.engines)
        offsets = [1 + sum(e.ranks for e in self.engines[:i]) for i in range(len(self.engines))]
        calls = _Concurrent(self, "/init_weights_update_group", [
            lambda api, off=off: api.init_weights_update_group(
                master_address=self.master_addr, master_port=self.master_port, rank_offset=off, world_size=world,
                group_name=self.group_name, backend=self.backend) for off in offsets])
        self.group = init_custom_process_group(
            backend=self.backend, init_method=f"tcp://{self.master_addr}:{self.master_port}", world_size=world,
            rank=0, group_name=self.group_name, timeout_s=self.timeout_s)
        calls.join()

    def close(self) -> None:
        """Leave the weight-update group on every side (servers first: a peer blocked in a broadcast
        on it is released when the other side destroys it)."""
        if self.group is None:
            return
        threads = [threading.Thread(target=api.destroy_group, args=(self.group_name,), daemon=True)
                   for api in self.apis]
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
            self.master_port = free_port()

    # ---------------------------------------------------------------------------------- session
    def session(self, items: Iterable[list[tuple[str, torch.Tensor]]], version: str, report,
                checksums: ChecksumAccumulator | None, load_format: str | None) -> None:
        """begin_weight_update -> buckets -> end_weight_update on every engine. ``items``: groups of tensors
        that must share a bucket (a delta's index and values); a bucket closes once past ``bucket_bytes``.
        ``report`` (a SyncReport) counts tensors, bytes and buckets."""
        opened: list[WeightUpdateAPI] = []
        try:
            for api in self.apis:
                api.begin_weight_update()
                opened.append(api)
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for item in items:
                for name, tensor in item:
                    bucket.append((name, tensor.contiguous()))
                    size += tensor.numel() * tensor.element_size()
                if size >= self.bucket_bytes:
                    self.send(bucket, version, report, checksums, load_format)
                    bucket, size = [], 0
            if bucket:
                self.send(bucket, version, report, checksums, load_format)
            while opened:
                opened[0].end_weight_update()
                opened.pop(0)
        except BaseException:
            for api in opened:  # close the sessions still open (the server finalizes what it has)
                api.quietly("/end_weight_update", {})
            raise

    def send(self, bucket: list[tuple[str, torch.Tensor]], version: str, report,
             checksums: ChecksumAccumulator | None, load_format: str | None = None) -> None:
        """One bucket: the update calls go out, then the broadcasts. A server that answers before the
        broadcasts are through (it refused, or died) means they can never complete: the group is
        destroyed on every side, which ends them, and the error names the server. Every tensor goes on the group's
        device first (the payload's are on the learner's device; a delta's and the baseline's on the CPU)."""
        if self.group is None:
            raise SyncError(f"no weight-update group {self.group_name!r} to send a bucket on: it was destroyed by "
                            "an abandoned broadcast or close(); connect() forms a new one")
        bucket = [(name, to_group_device(tensor, self.group)) for name, tensor in bucket]
        names, dtypes = [n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        calls = _Concurrent(self, "/update_weights_from_distributed", [
            lambda api: api.update_weights_from_distributed(names, dtypes, shapes, group_name=self.group_name,
                                                            weight_version=version, load_format=load_format)
        ] * len(self.apis))
        works = [broadcast(tensor, 0, self.group, async_op=True, name=name) for name, tensor in bucket]
        deadline = time.monotonic() + self.timeout_s
        try:
            while not all(w.is_completed() for w in works):
                if time.monotonic() > deadline:
                    raise SyncError(f"broadcast of a bucket of {len(bucket)} tensors ({names[0]} ...) not received "
                                    f"within rollout.sync.timeout_s={self.timeout_s:g} s by "
                                    f"{', '.join(e.url for e in self.engines)}")
                early = calls.failed()
                if early and not (all(map(_after_receiving, early)) and _complete_within(works, ANSWER_GRACE_S)):
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
        try:
            calls.join()
        except SyncError:
            if not all(map(_after_receiving, calls.problems(unanswered=True))):
                self.close()  # a server that refused before receiving leaves the group out of step (NCCL's root can
                # complete a small bucket into the connection buffers; gloo's tree relays through the other servers)
            raise
        for name, tensor in bucket:
            report.bytes += tensor.numel() * tensor.element_size()
            report.tensors += 1
            if checksums is not None:
                checksums.add(name, tensor)
        report.buckets += 1
        if self.progress is not None:
            self.progress(report.buckets, report.bytes)


# A server that refuses a bucket after receiving all of it (a bad delta, a tensor it does not hold: SGLang's "Failed
# to update parameter online", or its unflushed cache) can answer before this side's communication thread marks the
# last send complete (seen on a loaded 2-core CI machine): that refusal leaves no broadcast pending, so the group
# survives it once the sends complete within the grace. Any other refusal came before receiving: the group is
# destroyed, even where the root's sends completed (NCCL's root can finish a small bucket into the connection
# buffers; gloo's broadcast tree relays through the other servers).
ANSWER_GRACE_S = 5.0
AFTER_RECEIVING = (wire.LOAD_FAILED, wire.NOT_FLUSHED)


def _after_receiving(problem: str) -> bool:
    """Whether a server's refusal came after it had received the whole bucket (AFTER_RECEIVING)."""
    return any(marker in problem for marker in AFTER_RECEIVING)


def _complete_within(works: list, seconds: float) -> bool:
    """Whether every broadcast ``works`` completes within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not all(w.is_completed() for w in works):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class _Concurrent:
    """One call per engine, each in its own thread (they block server-side until the broadcasts end), joined
    after the broadcasts."""

    def __init__(self, owner: BroadcastTransport, path: str, calls: list[Callable[[WeightUpdateAPI], dict]]):
        self.owner, self.path = owner, path
        self.results: list = [None] * len(owner.apis)
        self.threads = [threading.Thread(target=self._run, args=(i, api, call), daemon=True)
                        for i, (api, call) in enumerate(zip(owner.apis, calls, strict=True))]
        for t in self.threads:
            t.start()

    def _run(self, i: int, api: WeightUpdateAPI, call: Callable[[WeightUpdateAPI], dict]) -> None:
        try:
            self.results[i] = call(api)
        except SyncError as err:
            self.results[i] = err

    def failed(self) -> list[str]:
        """The problems of the calls that have already answered with a failure (non-blocking)."""
        return self.problems(unanswered=False)

    def problems(self, unanswered: bool) -> list[str]:
        """Each failed call's problem; with ``unanswered``, a call that has not answered is one too."""
        out = []
        for api, result in zip(self.owner.apis, self.results, strict=True):
            if isinstance(result, SyncError):
                out.append(str(result))
            elif result is None:
                if unanswered:
                    out.append(f"{api.url}{self.path}: no answer")
            elif result.get("success") is False:
                out.append(f"{api.url}{self.path}: refused: {result.get('message')}")
        return out

    def join(self, timeout: float | None = None, cause: BaseException | None = None) -> list[dict]:
        for t in self.threads:
            t.join(timeout if timeout is not None else self.owner.timeout_s)
        problems = self.problems(unanswered=True)
        if problems:
            raise SyncError("; ".join(problems)) from cause
        return self.results
