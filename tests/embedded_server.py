"""The embedded rollout server in a thread of the test process (uvicorn on a free loopback port), for the tests that
drive its HTTP API while holding its engine (tests/test_rollout_server.py, tests/test_rollout_pipeline.py)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def serve_in_thread(engine):
    """The embedded server's app for ``engine`` on a free loopback port, run by uvicorn in a thread of this process;
    yields its base URL, then stops uvicorn and the engine."""
    import uvicorn

    from megatron_qarl.serve.server import ServerConfig, build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, ServerConfig(port=port)), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
