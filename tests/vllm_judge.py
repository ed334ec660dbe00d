"""Runs in the vLLM environment (its own python, .vllm-venv; never imported by the test session): vLLM 0.32's own
code judges what this project hands it. Reads a JSON list of tasks on stdin, writes a JSON list of answers on
stdout (one per task; an exception is answered as {"error": "Type: message"}).

Tasks:
  {"parse": argv}: what ``python -m vllm.entrypoints.launchers.api_server.entry <argv>`` makes of the command line:
      its main (vllm/entrypoints/launchers/api_server/entry.py) builds make_arg_parser(FlexibleArgumentParser),
      parses, validate_parsed_serve_args; the engine is built from AsyncEngineArgs.from_cli_args. Answers the
      engine-args fields this project sets.
  {"config": argv}: the same, then AsyncEngineArgs.create_engine_config(): vLLM's model, quantization and
      weight-transfer config for the checkpoint (vLLM verifies the checkpoint's quantization_config there).
  {"extension": qualname}: resolve the --worker-extension-cls as vLLM's worker does (resolve_obj_by_qualname,
      vllm/v1/worker/worker_base.py) and name the weight-transfer backends then registered with vLLM's factory
      (and vLLM's version).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def _args(argv: list[str]):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    return args, AsyncEngineArgs.from_cli_args(args)


def parse(argv: list[str]) -> dict:
    args, ea = _args(argv)
    wt = ea.weight_transfer_config
    return {"model": ea.model, "host": args.host, "port": args.port, "api_key": args.api_key, "dtype": ea.dtype,
            "max_num_seqs": ea.max_num_seqs, "seed": ea.seed, "enforce_eager": ea.enforce_eager,
            "logprobs_mode": ea.logprobs_mode, "tensor_parallel_size": ea.tensor_parallel_size,
            "worker_extension_cls": ea.worker_extension_cls, "middleware": args.middleware,
            "weight_transfer_backend": getattr(wt, "backend", None)}


def config(argv: list[str]) -> dict:
    _, ea = _args(argv)
    vc = ea.create_engine_config()
    mc = vc.model_config
    return {"quantization": mc.quantization, "dtype": str(mc.dtype), "max_model_len": mc.max_model_len,
            "logprobs_mode": mc.logprobs_mode, "quant_config": type(vc.quant_config).__name__ if vc.quant_config
            else None, "weight_transfer_backend": vc.weight_transfer_config.backend
            if vc.weight_transfer_config else None}


def extension(qualname: str) -> dict:
    import vllm
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.utils.import_utils import resolve_obj_by_qualname

    cls = resolve_obj_by_qualname(qualname)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "vllm": vllm.__version__,
            "backends": sorted(WeightTransferEngineFactory._registry)}


def main() -> None:
    tasks = json.load(sys.stdin)
    answers = []
    for task in tasks:
        (kind, arg), = task.items()
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                answers.append({"parse": parse, "config": config, "extension": extension}[kind](arg))
        except BaseException as err:  # noqa: BLE001 - argparse exits with SystemExit; every failure is an answer
            answers.append({"error": f"{type(err).__name__}: {err}", "log": log.getvalue()[-2000:]})
    print("\n@@JUDGE@@" + json.dumps(answers))


if __name__ == "__main__":
    main()
