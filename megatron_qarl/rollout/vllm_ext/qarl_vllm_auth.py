"""Runs INSIDE a vLLM 0.32 API server (its own environment: never imports megatron_qarl): an ASGI middleware that
asks every route but /health for the rollout API key, loaded by ``--middleware qarl_vllm_auth.RequireApiKey`` with
this directory on PYTHONPATH (rollout/vllm_launcher.py).

Why: the vLLM backend serves with VLLM_SERVER_DEV_MODE=1 for the weight-transfer routes, which also opens
/collective_rpc (any worker method by name), /pause, /reset_prefix_cache, /sleep and the other dev routes. vLLM's
own ``--api-key`` (or VLLM_API_KEY) guards only paths under /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py, ``GUARDED_PREFIX``), so on a node address (the Slurm launch:
``launch.server_host 0.0.0.0``) those routes would be open to the network. vLLM adds each ``--middleware`` class
with ``app.add_middleware(cls)`` and no arguments (vllm/entrypoints/serve/middleware/register.py), so the key comes
from the environment: VLLM_API_KEY, vLLM's own variable for its key, which the launcher sets (not ``--api-key``:
an argv is visible to every user of the node). Unset: every route is open (loopback servers only; the launcher
refuses a non-loopback host without a key). A request is let through when its ``Authorization: Bearer <key>``
header holds the key (compared as SHA-256 digests in constant time, as vLLM's middleware does); /health is let
through always (the launcher's readiness probe and the sync's liveness check send no key), and so is a CORS
preflight: an OPTIONS request with an Origin and an Access-Control-Request-Method header, which vLLM's
CORSMiddleware (inside this one) answers itself, without reaching a route (vLLM 0.32 allows no origin unless
--allowed-origins says: "400 Disallowed CORS origin"). Any other OPTIONS request needs the key:
the Prometheus app mounted at /metrics answers every method, OPTIONS with the metrics.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = ("/health",)


class RequireApiKey:
    """Pure ASGI middleware: 401 for any HTTP or websocket request without the key, but on ``OPEN_PATHS``."""

    def __init__(self, app) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV)
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    def allowed(self, scope) -> bool:
        if self.digest is None or scope["type"] not in ("http", "websocket"):
            return True
        headers = dict(scope.get("headers") or [])
        if scope.get("method") == "OPTIONS" and b"origin" in headers and b"access-control-request-method" in headers:
            return True  # a CORS preflight: CORSMiddleware answers it
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS:
            return True
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(hashlib.sha256(token.encode()).digest(),
                                                                     self.digest)

    async def __call__(self, scope, receive, send) -> None:
        if self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "missing or wrong API key (Authorization: Bearer <rollout.api_key>)"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
