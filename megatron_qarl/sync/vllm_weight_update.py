"""vLLM 0.32's weight-transfer HTTP protocol, the trainer's side: ``VLLMWeightUpdateAPI`` answers the calls the
broadcaster's transport makes of an engine (sync/transport.py, written for SGLang's protocol) with vLLM's
endpoints, so one transport (the group, the buckets, the abandon-on-failure) serves every backend.

vLLM's routes (vllm/entrypoints/rl/online/api_router.py and serve/dev/cache/api_router.py, served with
VLLM_SERVER_DEV_MODE=1); the tensors travel on our weight-transfer backend ``qarl``
(rollout/vllm_ext/qarl_vllm_ext.py, registered in vLLM's workers):

    SGLang call (sync/weight_update.py)      vLLM 0.32
    /pause_generation                        POST /pause?mode=wait (finish running requests, keep none queued;
                                             clears the KV and prefix caches)
    /flush_cache                             POST /reset_prefix_cache -> {"success": bool}, retried while false
    /continue_generation                     POST /resume
    /init_weights_update_group               POST /init_weight_transfer_engine {"init_info": {master_address,
                                             master_port, rank_offset, world_size, group_name, backend}}
    /destroy_weights_update_group            POST /shutdown_weight_transfer_engine
    /begin_weight_update                     POST /start_weight_update
    /update_weights_from_distributed         POST /update_weights {"update_info": {names, dtype_names, shapes}}
    /end_weight_update                       POST /finish_weight_update {"weight_version": the session's}
    /update_weight_version                   POST /update_weight_version {"new_version"}
    /get_model_info                          GET /weight_info (weight_version only)
    /weights_checker                         POST /weight_checker {"action": "checksum"} -> {"checksums"}:
                                             vLLM's checksums of its processed parameters (not the learner's)

What differs from SGLang: the weight version rides the session's end, not each bucket; there is no delta load
format (the config refuses ``rollout.sync.delta``); vLLM's checksums are of its repacked parameters, so a sync is
verified by comparing two of its own (an unchanged push must leave them equal: tests/test_vllm_server.py), not
against the learner's (the config refuses ``rollout.sync.verify``).
"""

from __future__ import annotations

import time

from megatron_qarl.sync.weight_update import SyncError, WeightUpdateAPI
from megatron_qarl.wire import group_timeout_s


class VLLMWeightUpdateAPI(WeightUpdateAPI):
    """The weight-update endpoints of one vLLM server, under the names the transport calls."""

    session_version: str | None = None

    def model_info(self) -> dict:
        return self.call("GET", "/weight_info")

    def pause_generation(self, mode: str = "abort") -> None:
        """vLLM's /pause in its ``wait`` mode (in-flight requests finish first). SGLang's ``abort`` needs nothing
        more (no request is in flight at a sync of the sequential and one-step loops); ``retract`` / ``in_place``
        keep requests alive across the sync, which this backend does not do (refused at config load)."""
        if mode != "abort":
            raise SyncError(f"pause mode {mode!r}: the vLLM backend pauses only between rollouts (train.async: "
                            "off or one_step)")
        self.call("POST", "/pause?mode=wait", {})

    def flush_cache(self, tries: int = 50) -> None:
        for _ in range(tries):
            if self.call("POST", "/reset_prefix_cache", {}).get("success"):
                return
            time.sleep(0.1)
        raise SyncError(f"{self.url}/reset_prefix_cache: still refused after {tries} tries (blocks held)")

    def continue_generation(self) -> None:
        self.call("POST", "/resume", {})

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> dict:
        # timeout_s: the workers' side of the group waits as long as the trainer's (rollout.sync.timeout_s + the
        # margin, wire.group_timeout_s), not QarlInitInfo's default of 300 s
        self.call("POST", "/init_weight_transfer_engine", {"init_info": {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
            "timeout_s": group_timeout_s(self.timeout_s)}})
        return {"success": True}

    def destroy_group(self, group_name: str) -> None:
        self.quietly("/shutdown_weight_transfer_engine", {})

    def begin_weight_update(self) -> dict:
        self.session_version = None
        self.call("POST", "/start_weight_update", {})
        return {"success": True}

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                        group_name: str, weight_version: str, load_format: str | None = None) -> dict:
        if load_format is not None:
            raise SyncError(f"{self.url}: vLLM has no load format {load_format!r} (no delta sync for vLLM)")
        self.session_version = weight_version
        self.call("POST", "/update_weights", {"update_info": {"names": names, "dtype_names": dtypes,
                                                              "shapes": shapes}})
        return {"success": True}

    def end_weight_update(self) -> dict:
        body = {"weight_version": self.session_version} if self.session_version else {}
        self.call("POST", "/finish_weight_update", body)
        return {"success": True}

    def update_weight_version(self, version: str) -> dict:
        return self.call("POST", "/update_weight_version", {"new_version": version})

    def checksums(self) -> dict[str, str]:
        return self.call("POST", "/weight_checker", {"action": "checksum"}).get("checksums", {})
