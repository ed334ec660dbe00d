"""The weight-update group and the bucketed broadcast over it (learner rank 0's side).

The group is the one SGLang expects: the trainer is rank 0, engine i joins with rank_offset = 1 + the ranks of
the engines before it, world_size = 1 + all engine ranks; gloo on CPU, NCCL on GPUs. One session is
begin_weight_update -> per bucket: POST /update_weights_from_distributed to every engine (names, dtypes, shapes, in
order) while broadcasting each tensor from rank 0 in that same order -> end_weight_update. A bucket closes once it
holds ``bucket_bytes``. A broadcast that cannot complete (a server refused its bucket or died) is abandoned by
destroying the group on every side, so no collective stays pending; the next ``connect`` forms a new group.
The HTTP requests are sync/weight_update.py's.

Bounds (docs/cluster.md, "Every wait is bounded"). rank 0's I/O comes in stretches, each within one
``timeout_s`` (rollout.sync.timeout_s; ``stretch``: every HTTP call of it waits only what is left): the broadcaster's
preamble (health, the group's rendezvous, pause, flush), a session's start, one bucket (its broadcast and every
server's answer), a session's end. Abandoning a group adds at most ``CLEANUP_S`` (its local side is destroyed first,
then the servers are told). The other learner ranks wait in the sync's collectives while rank 0 does this, at most
two stretches between two of them: ``peer_wait_s``, the timeout of the sync's own groups (moe/parallelize.py
``sync_groups``). The group itself times out ``wire.GROUP_MARGIN_S`` after the deadline (NCCL's watchdog would
otherwise end the process before the SyncError is raised).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from megatron_qarl import wire
from megatron_qarl.moe.parallelize import broadcast, dist_backend, free_port, to_group_device
from megatron_qarl.sync.checksum import ChecksumAccumulator
from megatron_qarl.sync.weight_update import CLEANUP_S, Engine, SyncError, WeightUpdateAPI
from megatron_qarl.wire import dtype_name, group_timeout_s, init_custom_process_group

# what the other learner ranks' wait allows beyond rank 0's stretches: thread hand-overs, the payload's own work
PEER_SLACK_S = 30.0


def peer_wait_s(timeout_s: float) -> float:
    """How long a learner rank other than 0 may wait in one of the sync's collectives (the timeout of the sync's own
    groups): the longest stretch of rank 0's I/O between two of them, + PEER_SLACK_S. Two stretches at most lie
    between two collectives (each ``timeout_s``), and one abandoned group's CLEANUP_S: before the first gather the
    preamble (which closes a stale group) and the sessions' start; before the outcome the last bucket (abandoned on a
    failure) and the sessions' end:

        peer_wait = 2 * timeout_s + CLEANUP_S + PEER_SLACK_S      (timeout_s = rollout.sync.timeout_s)
    """
    return 2 * timeout_s + CLEANUP_S + PEER_SLACK_S


def all_at_once(apis: list[WeightUpdateAPI], method: Callable[[WeightUpdateAPI], object], wait_s: float) -> None:
    """``method(api)`` on every engine in its own thread, all joined within one ``wait_s`` (best-effort cleanup: a
    call still running then is left to its own HTTP timeout, on a daemon thread)."""
    threads = [threading.Thread(target=method, args=(api,), daemon=True) for api in apis]
    for t in threads:
        t.start()
    deadline = time.monotonic() + wait_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


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
        self.opened: list[WeightUpdateAPI] = []  # engines whose weight-update session is open

    @contextlib.contextmanager
    def stretch(self):
        """One stretch of rank 0's sync I/O: every engine call inside it shares one ``timeout_s`` (its deadline);
        a call made after the deadline fails at once, naming the server. Stretches nest: the outer deadline holds."""
        previous = [api.deadline for api in self.apis]
        deadline = time.monotonic() + self.timeout_s
        for api, prev in zip(self.apis, previous, strict=True):
            api.deadline = deadline if prev is None else prev
        try:
            yield
        finally:
            for api, prev in zip(self.apis, previous, strict=True):
                api.deadline = prev

    def each(self, method: Callable[[WeightUpdateAPI], object]) -> None:
        """Call ``method(api)`` on every engine in turn (pause, flush, continue, ...), within one stretch."""
        with self.stretch():
            for api in self.apis:
                method(api)

    # ------------------------------------------------------------------------------------ group
    def connect(self) -> None:
        """Form the weight-update group with every engine (no-op while one exists), within one stretch: the
        rendezvous waits what is left of it; the group's own timeout is ``wire.group_timeout_s`` (rollout.sync.
        timeout_s + the margin)."""
        if self.group is not None:
            return
        with self.stretch():
            self.each(WeightUpdateAPI.health)  # fail fast, naming the server, rather than wait for a group
            world = 1 + sum(e.ranks for e in self.engines)
            offsets = [1 + sum(e.ranks for e in self.engines[:i]) for i in range(len(self.engines))]
            calls = _Concurrent(self, "/init_weights_update_group", [
                lambda api, off=off: api.init_weights_update_group(
                    master_address=self.master_addr, master_port=self.master_port, rank_offset=off, world_size=world,
                    group_name=self.group_name, backend=self.backend) for off in offsets])
            deadline = self.apis[0].deadline if self.apis else time.monotonic() + self.timeout_s
            try:
                self.group = init_custom_process_group(
                    backend=self.backend, init_method=f"tcp://{self.master_addr}:{self.master_port}",
                    world_size=world, rank=0, group_name=self.group_name, timeout_s=group_timeout_s(self.timeout_s),
                    rendezvous_s=max(1.0, deadline - time.monotonic()))
            except Exception as err:
                calls.join(deadline, cause=err)  # the servers' own answers name what went wrong
                raise SyncError(f"the weight-update group's rendezvous failed: {type(err).__name__}: {err}") from err
            calls.join(deadline)

    def close(self) -> None:
        """Leave the weight-update group on every side: the local side first (on NCCL an abort, which ends a
        broadcast still pending on it at once, before NCCL's watchdog would end this process), then every server
        is told at once, within CLEANUP_S (its side, blocked in the broadcast, ends when this side goes)."""
        if self.group is None:
            return
        group, self.group = self.group, None
        try:
            if "nccl" in str(dist.get_backend(group)):
                dist.distributed_c10d._abort_process_group(group)
            else:
                dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - a group broken by a dead peer may refuse a clean shutdown
            pass
        all_at_once(self.apis, lambda api: api.destroy_group(self.group_name), CLEANUP_S)
        if self._auto_port:
            self.master_port = free_port()

    def abandon(self) -> None:
        """After a failed sync: close every session still open (the server finalizes what it has), all at once,
        within CLEANUP_S."""
        opened, self.opened = self.opened, []
        all_at_once(opened, lambda api: api.quietly("/end_weight_update", {}), CLEANUP_S)

    def begin(self) -> None:
        """begin_weight_update on every engine whose session is not open yet."""
        for api in self.apis:
            if api not in self.opened:
                api.begin_weight_update()
                self.opened.append(api)

    # ---------------------------------------------------------------------------------- session
    def session(self, items: Iterable[list[tuple[str, torch.Tensor]]], version: str, report,
                checksums: ChecksumAccumulator | None, load_format: str | None) -> None:
        """begin_weight_update (where not begun yet: ``begin``) -> buckets -> end_weight_update on every engine, each
        its own stretch. ``items``: groups of tensors that must share a bucket (a delta's index and values); a bucket
        closes once past ``bucket_bytes``. ``report`` (a SyncReport) counts tensors, bytes and buckets. On a failure
        the sessions still open stay in ``opened`` for ``abandon`` (the broadcaster calls it once the other learner
        ranks have been told: they wait in the sync's collectives until then)."""
        with self.stretch():
            self.begin()
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
        with self.stretch():
            while self.opened:
                self.opened[0].end_weight_update()
                self.opened.pop(0)

    def send(self, bucket: list[tuple[str, torch.Tensor]], version: str, report,
             checksums: ChecksumAccumulator | None, load_format: str | None = None) -> None:
        """One bucket: the update calls go out, then the broadcasts. A server that answers before the
        broadcasts are through (it refused, or died) means they can never complete: the group is
        destroyed on every side, which ends them, and the error names the server. Every tensor goes on the group's
        device first (the payload's are on the learner's device; a delta's and the baseline's on the CPU). One stretch:
        the broadcasts and every server's answer within one rollout.sync.timeout_s."""
        if self.group is None:
            raise SyncError(f"no weight-update group {self.group_name!r} to send a bucket on: it was destroyed by "
                            "an abandoned broadcast or close(); connect() forms a new one")
        with self.stretch():
            self._send(bucket, version, report, checksums, load_format)

    def _send(self, bucket: list[tuple[str, torch.Tensor]], version: str, report,
              checksums: ChecksumAccumulator | None, load_format: str | None) -> None:
        bucket = [(name, to_group_device(tensor, self.group)) for name, tensor in bucket]
        names, dtypes = [n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        deadline = self.apis[0].deadline if self.apis else time.monotonic() + self.timeout_s
        calls = _Concurrent(self, "/update_weights_from_distributed", [
            lambda api: api.update_weights_from_distributed(names, dtypes, shapes, group_name=self.group_name,
                                                            weight_version=version, load_format=load_format)
        ] * len(self.apis))
        works = [broadcast(tensor, 0, self.group, async_op=True, name=name) for name, tensor in bucket]
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
            calls.join(time.monotonic() + 5.0, cause=err)  # a peer died mid-broadcast: name who did not answer
            raise SyncError(f"broadcast of a bucket of {len(bucket)} tensors failed: {err}") from err
        try:
            calls.join(deadline)
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
                    out.append(f"{api.url}{self.path}: no answer within rollout.sync.timeout_s="
                               f"{self.owner.timeout_s:g} s")
            elif result.get("success") is False:
                out.append(f"{api.url}{self.path}: refused: {result.get('message')}")
        return out

    def join(self, deadline: float, cause: BaseException | None = None) -> list[dict]:
        """Wait for every call until ``deadline`` (time.monotonic()); a SyncError naming each server whose call failed
        or did not answer by then."""
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        problems = self.problems(unanswered=True)
        if problems:
            raise SyncError("; ".join(problems)) from cause
        return self.results
