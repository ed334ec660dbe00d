"""The trainer's client for SGLang's generation endpoint (POST /generate), the same object for the embedded
CPU server (`qarl serve`) and a real SGLang server. The weight-update endpoints are
megatron_qarl/sync/weight_update.py's (blocking, no retries: an update is not idempotent).

Async (httpx), with bounded concurrency (at most ``max_concurrency`` requests in flight per server),
a timeout per request, and retries with exponential back-off on connection errors, timeouts and
5xx answers. 4xx answers are the caller's mistake and raise at once with the server's message.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx

from megatron_qarl.utils.http import tls_context
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
                                       transport=transport, verify=tls_context())
        self._slots = asyncio.Semaphore(self.config.max_concurrency)

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, payload: dict | None = None) -> Any:
        attempts = 1 + self.config.retries
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
