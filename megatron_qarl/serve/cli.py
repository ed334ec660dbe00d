"""``qarl serve``: the command line of the embedded rollout server (serve/server.py), a Qwen3-MoE checkpoint
(BF16 or a ``qarl quantize`` export) served over SGLang's native HTTP API with uvicorn."""

from __future__ import annotations

import json
import logging

from megatron_qarl.errors import UserError
from megatron_qarl.moe.model_dir import check_model_dir
from megatron_qarl.serve.engine import Engine, EngineConfig
from megatron_qarl.serve.server import ServerConfig, build_app
from megatron_qarl.utils import api_key


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a Qwen3-MoE checkpoint (bf16 or qat/ export) over SGLang's API")
    p.add_argument("--model", required=True, help="Hugging Face model dir (bf16/fp32 or w4a16/w8a8 export)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="the key every admin route asks for (default: $QARL_API_KEY, "
                   "which launchers use: an argv is visible to every user of the node); required when --host is not "
                   "loopback")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="answer return_routed_experts requests (SGLang's flag; routing replay, R3)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of the engine (default: torch's, one per core); on a machine shared with "
                        "a learner, fewer threads avoid OpenMP stalls when a core is taken (BENCHMARKS.md)")
    p.add_argument("--numerics", choices=["default", "exact"], default="default",
                   help="exact: every token through megatron_qarl/numerics/ (bitwise the learner's log-probs under "
                        "numerics: exact; docs/numerics.md)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3", "fp8_e5m2"], default="auto",
                   help="SGLang's flag: the KV cache in the compute dtype (auto) or FP8, written and read as SGLang "
                        "does (megatron_qarl/qat/kv_cache.py)")
    p.add_argument("--kv-cache-mib", type=float, default=None,
                   help="the KV cache's memory in MiB: the slots are at most the full-length sequences it holds "
                        "(twice as many in FP8 as in bf16); default: --max-batch-size slots")
    p.set_defaults(func=_serve)


def _configure_logging() -> None:
    """The server log (stderr): warnings of any module, and which kernel each low-bit layer runs and why
    (kernels/linear.py, kernels/native.py at INFO; kernels/speed_check.py warns when a scheme is slower than BF16)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    for name in ("megatron_qarl.serve.kernels.linear", "megatron_qarl.serve.kernels.native"):
        logging.getLogger(name).setLevel(logging.INFO)


def _serve(args) -> int:
    import uvicorn

    _configure_logging()
    server_cfg = ServerConfig(host=args.host, port=args.port, api_key=args.api_key or api_key.from_env())
    if not server_cfg.loopback and not server_cfg.api_key:
        raise UserError(f"--host {args.host} is not loopback: an API key is required (${api_key.ENV}, or --api-key)")
    check_model_dir(args.model)  # config.json and every weight file, named when corrupt or incomplete
    try:
        engine = Engine(EngineConfig(model_path=args.model, dtype=args.dtype, max_batch_size=args.max_batch_size,
                                     max_seq_len=args.max_seq_len, num_threads=args.num_threads,
                                     enable_return_routed_experts=args.enable_return_routed_experts,
                                     numerics=args.numerics, kv_cache_dtype=args.kv_cache_dtype,
                                     kv_cache_mib=args.kv_cache_mib))
    except (KeyError, ValueError, json.JSONDecodeError) as err:
        raise UserError(f"--model {args.model}: {err}") from None
    app = build_app(engine, server_cfg)
    try:
        uvicorn.run(app, host=server_cfg.host, port=server_cfg.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0
