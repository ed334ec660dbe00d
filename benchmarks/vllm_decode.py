"""Decode tokens/s of vLLM 0.32 vs the embedded engine, served over HTTP on the same machine in one run.

Both servers are started the way ``qarl train`` starts them (launch/fleet.py ``server_command``, rollout.backend
embedded and vllm, each on the tiny checkpoint or its export), one after the other (never both at once: they would
share the cores). For batch sizes 1 and 16: ``--repeats`` rounds of ``batch`` concurrent requests, each a 16-token
prompt and ``--new-tokens`` sampled tokens (temperature 1, seeded, no stop token, so every request decodes the
same length); tok/s = generated tokens / wall seconds of the round, best round reported (the machine is shared).

    .venv/bin/python benchmarks/vllm_decode.py --schemes bf16 [w4a16] --vllm-python .vllm-venv/bin/python
W4A16 needs a CPU with AMX for vLLM (docs/rollout.md, "vLLM as a rollout backend").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_qarl.launch.fleet import server_command, server_env  # noqa: E402
from megatron_qarl.moe.parallelize import free_port  # noqa: E402
from megatron_qarl.preflight.rules import load_config  # noqa: E402
from megatron_qarl.rollout.client import ClientConfig, SGLangClient  # noqa: E402
from megatron_qarl.rollout.process import ServerProcess  # noqa: E402
from megatron_qarl.rollout.vllm_client import VLLMClient  # noqa: E402
from megatron_qarl.train.cli import rollout_model_dir  # noqa: E402

CONFIG = {"bf16": "configs/cpu_bf16_rollout.yaml", "w4a16": "configs/cpu_default.yaml"}


async def _round(client, batch: int, new_tokens: int, seed: int) -> tuple[int, float]:
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": new_tokens, "stop_token_ids": []}
    prompts = [[(7 * i + j) % 28 + 3 for j in range(16)] for i in range(batch)]
    t0 = time.perf_counter()
    answers = await asyncio.gather(*(client.generate(p, {**params, "sampling_seed": seed + i})
                                     for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - t0
    return sum(len(a["meta_info"]["output_token_logprobs"]) for a in answers), seconds


def measure(backend: str, scheme: str, args, out_dir: Path) -> dict:
    over = [f"rollout.backend={backend}", f"train.output_dir={out_dir / f'{backend}_{scheme}'}",
            "launch.backend=local", "rollout.startup_timeout_s=1200", "rollout.dtype=bfloat16"]
    if backend == "vllm":
        over.append(f"rollout.server_python={args.vllm_python}")
    cfg = load_config(REPO / CONFIG[scheme], over)
    port = free_port()
    server = ServerProcess(server_command(cfg, rollout_model_dir(cfg), "127.0.0.1", port), f"http://127.0.0.1:{port}",
                           out_dir / f"{backend}_{scheme}.log", env=server_env(cfg), startup_timeout_s=1200)
    t0 = time.perf_counter()
    server.start()
    startup = time.perf_counter() - t0
    rows = {"backend": backend, "scheme": scheme, "startup_s": round(startup, 1)}
    cls = VLLMClient if backend == "vllm" else SGLangClient

    async def run():
        async with cls(server.url, config=ClientConfig(timeout_s=1200, max_concurrency=64)) as client:
            await _round(client, 1, 4, 0)  # warm-up
            for batch in (1, 16):
                best = 0.0
                for r in range(args.repeats):
                    tokens, seconds = await _round(client, batch, args.new_tokens, 1000 * r)
                    best = max(best, tokens / seconds)
                rows[f"tok/s b={batch}"] = round(best, 1)

    try:
        asyncio.run(run())
    finally:
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=["bf16"], choices=sorted(CONFIG))
    parser.add_argument("--vllm-python", default=str(REPO / ".vllm-venv" / "bin" / "python"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(b, s, args, Path(tmp)) for s in args.schemes for b in ("embedded", "vllm")]
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
