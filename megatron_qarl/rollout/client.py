"""The trainer's client for SGLang's HTTP protocol: one method per endpoint, the same object for the
embedded CPU server (`qarl serve`) and a real SGLang server.

Async (httpx), with bounded concurrency (at most ``max_concurrency`` requests in flight per server),
a timeout per request, and retries with exponential back-off on connection errors, timeouts and
5xx answers. 4xx answers are the caller's mistake and raise at once with the server's message.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx

from megatron_qarl.wire import response_body


class RolloutServerError(RuntimeError):
    """A request to a rollout server failed; the message names the server and the endpoint."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientConfig:
    timeout_s: float = 600.0
    retries: int = 3
    backoff_s: float = 0.5
    max_concurrency: int = 64


class SGLangClient:
    """One rollout server. Use as ``async with SGLangClient(url) as c: await c.generate(...)``."""

    def __init__(self, url: str, *, api_key: str | None = None, config: ClientConfig | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.url = url.rstrip("/")
        self.config = config or ClientConfig()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=self.config.timeout_s,
                                       transport=transport)
        self._slots = asyncio.Semaphore(self.config.max_concurrency)

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, payload: dict | None = None, *, retries: int | None = None) -> Any:
        attempts = 1 + (self.config.retries if retries is None else retries)
        last = None
        for attempt in range(attempts):
            try:
                async with self._slots:
                    r = await self._http.request(method, path, json=payload)
            except (httpx.TransportError, httpx.TimeoutException) as err:
                last = RolloutServerError(f"{self.url}{path}: {type(err).__name__}: {err}")
            else:
                if r.status_code < 400:
                    return response_body(r)
                last = RolloutServerError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:500]}", r.status_code)
                if r.status_code < 500:
                    raise last
            if attempt + 1 < attempts:
                await asyncio.sleep(self.config.backoff_s * 2**attempt)
        raise last

    # ------------------------------------------------------------------------------ generation
    async def generate(self, input_ids: list[int] | list[list[int]], sampling_params: dict, *,
                       return_logprob: bool = True, logprob_start_len: int = -1, **extra) -> dict | list[dict]:
        """POST /generate. Returns SGLang's response: one dict, or a list for batched input_ids."""
        payload = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob,
                   "logprob_start_len": logprob_start_len, **extra}
        return await self._request("POST", "/generate", payload)

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health", retries=0)
            return True
        except RolloutServerError:
            return False

    async def get_model_info(self) -> dict:
        return await self._request("GET", "/get_model_info")

    # ----------------------------------------------------------------------------------- admin
    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache", retries=0)

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {})

    # --------------------------------------------------------------------------- weight update
    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict:
        return await self._request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, retries=0)

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              weight_version: str | None = None,
                                              load_format: str | None = None) -> dict:
        return await self._request("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": weight_version, "load_format": load_format}, retries=0)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_disk(self, model_path: str, *, load_format: str | None = None,
                                       weight_version: str | None = None) -> dict:
        return await self._request("POST", "/update_weights_from_disk", {
            "model_path": model_path, "load_format": load_format, "weight_version": weight_version}, retries=0)

    async def begin_weight_update(self, selector: str = "all") -> dict:
        """Open the weight-update session that SGLang requires around update_weights_from_* (400 if open)."""
        return await self._request("POST", "/begin_weight_update", {"selector": selector}, retries=0)

    async def end_weight_update(self) -> dict:
        """Close the session; the server finalizes (repacks) the weights loaded in it."""
        return await self._request("POST", "/end_weight_update", {}, retries=0)

    async def weights_checker(self, action: str = "checksum", *, skip_tensor_list: list[str] | None = None) -> dict:
        """SGLang's /weights_checker: with ``checksum``, ``{success, message, ranks: [{checksums,
        per_gpu_checksum, parallelism_info}], per_engine_checksum}`` (megatron_qarl/sync/checksum.py)."""
        payload: dict[str, Any] = {"action": action}
        if skip_tensor_list is not None:
            payload["skip_tensor_list"] = skip_tensor_list
        return await self._request("POST", "/weights_checker", payload)
