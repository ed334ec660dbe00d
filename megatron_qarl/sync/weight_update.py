"""SGLang's weight-update HTTP protocol, the trainer's side: one method per endpoint of one server.

The only module that builds these requests (the broadcaster's transport calls it; rollout/client.py speaks the
generation side). Field names and answers are SGLang 0.5.23's (sglang/srt/entrypoints/http_server.py and
sglang/srt/managers/io_struct.py; tests/test_sglang_contract.py has SGLang's own request types judge every body):

    GET  /health, /get_model_info
    POST /pause_generation, /flush_cache (400 while requests are pending), /continue_generation
    POST /init_weights_update_group, /destroy_weights_update_group
    POST /begin_weight_update -> /update_weights_from_distributed (per bucket) -> /end_weight_update
    POST /update_weight_version (a new version name for unchanged weights)
    POST /weights_checker {"action": "checksum"}

Blocking (httpx), one call per request, no retries: a weight update is not idempotent. A transport error or a
4xx/5xx is a SyncError naming the server and the endpoint; an answer ``{"success": false, ...}`` is returned as
is (the transport decides what a refusal means mid-broadcast). Each call waits ``timeout_s``
(rollout.sync.timeout_s) at most, and no longer than the ``deadline`` of the stretch of the sync it belongs to
(sync/transport.py ``BroadcastTransport.stretch``: every call of one stretch shares one rollout.sync.timeout_s); a
best-effort cleanup call (``quietly``: a failed sync's ends, continues and the group's destroy) waits ``CLEANUP_S``.
"""

from __future__ import annotations

import dataclasses
import time

import httpx

from megatron_qarl.utils.http import tls_context
from megatron_qarl.wire import response_body

# how long a best-effort cleanup call waits for its server (a failed sync's end_weight_update, continue_generation,
# the weight-update group's destroy): the cleanup of a failed sync is bounded by this, whatever rollout.sync.timeout_s
CLEANUP_S = 30.0


class SyncError(RuntimeError):
    """A weight sync failed; the message names the server."""


@dataclasses.dataclass(frozen=True)
class Engine:
    url: str  # http://host:port
    ranks: int = 1  # the engine's tensor-parallel ranks in the weight group
    api_key: str | None = None


class WeightUpdateAPI:
    """The weight-update endpoints of one rollout server (SGLang or `qarl serve`)."""

    def __init__(self, engine: Engine, timeout_s: float = 300.0):
        self.engine, self.timeout_s = engine, timeout_s
        self.deadline: float | None = None  # time.monotonic() by which the current stretch of the sync must end

    @property
    def url(self) -> str:
        return self.engine.url

    def _budget(self, path: str, cap: float | None = None) -> float:
        """Seconds a call to ``path`` may wait: ``timeout_s`` (or ``cap``), and no more than what is left of the
        stretch's ``deadline``; a SyncError naming the server when nothing is left."""
        limit = self.timeout_s if cap is None else min(cap, self.timeout_s)
        if self.deadline is None:
            return limit
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise SyncError(f"{self.url}{path}: not called: this stretch of the weight sync has used its "
                            f"rollout.sync.timeout_s={self.timeout_s:g} s")
        return min(limit, left)

    def call(self, method: str, path: str, payload: dict | None = None, timeout_s: float | None = None) -> dict:
        """One HTTP call, waiting ``timeout_s`` if given, else ``_budget``; a transport error or a 4xx/5xx is a
        SyncError naming the server and the endpoint."""
        key = self.engine.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        timeout = self._budget(path) if timeout_s is None else timeout_s
        try:
            if method == "POST":
                r = httpx.post(self.url + path, json=payload or {}, headers=headers, timeout=timeout,
                               verify=tls_context())
            else:
                r = httpx.get(self.url + path, headers=headers, timeout=timeout, verify=tls_context())
        except httpx.HTTPError as err:
            raise SyncError(f"{self.url}{path}: {type(err).__name__}: {err}") from None
        if r.status_code >= 400:
            raise SyncError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        body = response_body(r)
        return body if isinstance(body, dict) else {"text": body}

    def quietly(self, path: str, payload: dict | None = None) -> None:
        """Best-effort cleanup call, ``CLEANUP_S`` at most whatever the stretch has left: a dead or refusing server
        has nothing to clean up."""
        try:
            self.call("POST", path, payload, timeout_s=CLEANUP_S)
        except SyncError:
            pass

    # ---------------------------------------------------------------------------------- state
    def health(self) -> None:
        """GET /health (no key needed, short timeout): fail fast, naming the server, before a group is formed."""
        try:
            timeout = self._budget("/health", 10.0)
            httpx.get(self.url + "/health", timeout=timeout, verify=tls_context()).raise_for_status()
        except httpx.HTTPError as err:
            raise SyncError(f"{self.url}/health: {type(err).__name__}: {err}") from None

    def model_info(self) -> dict:
        """GET /get_model_info: ``weight_version``, ``dtype``, ..."""
        return self.call("GET", "/get_model_info")

    def pause_generation(self, mode: str = "abort") -> None:
        """POST /pause_generation. ``abort`` (SGLang's default, an empty body): running requests end with
        finish_reason abort; ``retract``: they go back to the queue without their KV cache and are re-prefilled
        with the new weights on /continue_generation (the bounded-staleness pipeline's choice, trainer side:
        megatron_qarl/train/pipeline.py)."""
        self.call("POST", "/pause_generation", {} if mode == "abort" else {"mode": mode})

    def flush_cache(self, tries: int = 50) -> None:
        """POST /flush_cache, retried while the server answers 400 (requests still pending), as trainers do."""
        for _ in range(tries):
            try:
                self.call("POST", "/flush_cache")
                return
            except SyncError as err:
                if "HTTP 400" not in str(err):
                    raise
                time.sleep(0.1)
        raise SyncError(f"{self.url}/flush_cache: still busy after {tries} tries")

    def continue_generation(self) -> None:
        self.call("POST", "/continue_generation", {})

    def quietly_continue(self) -> None:
        """``continue_generation``, best effort and ``CLEANUP_S`` at most (after a failed sync: a dead server has
        nothing to continue)."""
        deadline, self.deadline = self.deadline, time.monotonic() + CLEANUP_S
        try:
            self.continue_generation()
        except SyncError:
            pass
        finally:
            self.deadline = deadline

    # ---------------------------------------------------------------------------------- group
    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> dict:
        """Join the trainer's group as ranks [rank_offset, rank_offset + engine.ranks); blocks server-side until
        the trainer (rank 0) joins too."""
        return self.call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def destroy_group(self, group_name: str) -> None:
        """POST /destroy_weights_update_group, best effort (a dead server has no group left)."""
        self.quietly("/destroy_weights_update_group", {"group_name": group_name})

    # ----------------------------------------------------------------------- the update session
    def begin_weight_update(self) -> dict:
        return self.call("POST", "/begin_weight_update", {})

    def end_weight_update(self) -> dict:
        return self.call("POST", "/end_weight_update", {})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                        group_name: str, weight_version: str, load_format: str | None = None) -> dict:
        """Receive one bucket: the tensors, in this order, that rank 0 broadcasts on the group (blocks server-side
        until the broadcasts end). ``load_format="delta"`` is ours (sync/delta.py), the embedded server's only."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": True,
                "weight_version": weight_version}
        if load_format is not None:
            body["load_format"] = load_format
        return self.call("POST", "/update_weights_from_distributed", body)

    def update_weight_version(self, version: str) -> dict:
        """Name the held, unchanged weights ``version`` (running requests are left alone)."""
        return self.call("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})

    # ---------------------------------------------------------------------------------- check
    def checksums(self) -> dict[str, str]:
        """name -> checksum of every tensor the server holds (/weights_checker, all its ranks; sync/checksum.py)."""
        body = self.call("POST", "/weights_checker", {"action": "checksum"})
        held: dict[str, str] = {}
        for rank in body.get("ranks") or []:
            held.update(rank.get("checksums", {}))
        return held
