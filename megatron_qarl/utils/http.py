"""What every HTTP call of the trainer side shares (httpx; the rollout client, the weight-update API, the
launchers' health polls)."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default verifying TLS context, built once per process and passed as ``verify=`` to every call.

    httpx builds a new one for every Client, loading certifi's CA bundle, and so for every module-level
    ``httpx.post``/``httpx.get``: about 50 ms of CPU per call on a 2-core CPU machine, for plain http:// URLs too,
    which made a weight sync of many buckets (one POST each) slow. The context is only read once built."""
    return httpx.create_ssl_context()
