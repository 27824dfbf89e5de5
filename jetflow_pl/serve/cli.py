"""`jetflow-serve` / `python -m jetflow_pl.serve`: the OpenAI-compatible server (docs/SERVING.md).

Serves a target + head (`--backend torch`, batched: `--max-batch` requests decode together) or an
exported engine directory (`--engine-dir DIR --backend onnxruntime|tensorrt`, enough alone: it carries
the graphs, config and tokenizer, and the model name is the folder's; batch-1 engines serve one request at
a time through the same API). The model loading and the flags shared with `jetflow-generate` are in
`decode_options`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jetflow_pl.decode_options import (
    add_cost_profile_arguments,
    add_threads_argument,
    budget_policy,
    check_device,
    int_at_least,
    load_models,
    parse_budget,
)
from jetflow_pl.errors import NumericalError, UserInputError

log = logging.getLogger("jetflow_pl.serve")


def build_parser() -> argparse.ArgumentParser:
    from jetflow_pl.runtime.loader import BACKEND_KINDS

    p = argparse.ArgumentParser(prog="jetflow-serve", description=__doc__.splitlines()[0])
    p.add_argument(
        "--target",
        type=Path,
        default=None,
        help="target model directory (HF format; optional with --engine-dir)",
    )
    p.add_argument(
        "--head",
        type=Path,
        default=None,
        help="draft head directory; omitted = untrained head (an --engine-dir's graphs hold their own head)",
    )
    p.add_argument(
        "--backend",
        choices=[*BACKEND_KINDS, "graph"],
        default=None,
        help="torch (default with --target; batched), torch-graph, onnxruntime / tensorrt (default "
        "onnxruntime with --engine-dir; batched when exported with --max-batch)",
    )
    p.add_argument(
        "--engine-dir", type=Path, default=None, help="engine directory (written by jetflow-export)"
    )
    p.add_argument("--device", default="cpu")
    add_threads_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 to serve other machines)")
    p.add_argument("--port", type=int_at_least(0), default=8000)
    p.add_argument(
        "--served-model-name", default=None, help="the `model` clients send (default: the folder name)"
    )
    p.add_argument("--max-batch", type=int_at_least(1), default=8, help="requests decoding together")
    p.add_argument("--max-queue", type=int_at_least(0), default=64, help="waiting requests before 429")
    p.add_argument(
        "--max-kv-tokens",
        type=int_at_least(1),
        default=None,
        help="KV positions the requests in flight may reserve together (prompt + max_tokens each)",
    )
    p.add_argument(
        "--prefill-chunk", type=int_at_least(1), default=256, help="prompt tokens prefilled per step"
    )
    p.add_argument(
        "--budget",
        type=parse_budget,
        default="auto",
        help="draft tokens per tree; 0 = AR; auto (default) = per round from this machine's cost profile "
        "at the batch size being served",
    )
    p.add_argument("--width", type=int_at_least(1), default=4, help="children per expanded node")
    add_cost_profile_arguments(p)
    p.add_argument("--acceptance-profile", type=Path, default=None, help="--budget auto: acceptance prior")
    p.add_argument(
        "--max-tokens-limit", type=int_at_least(1), default=None, help="largest max_tokens allowed"
    )
    p.add_argument(
        "--default-max-tokens",
        type=int_at_least(1),
        default=256,
        help="max_tokens of a chat request without one",
    )
    p.add_argument("--retry-after", type=int_at_least(1), default=1, help="Retry-After seconds of a 429")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def load_server_parts(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """(generator, tokenizer, served model name) from the flags; bad flags are one `UserInputError`."""
    from jetflow_pl.decoding import SpeculativeGenerator
    from jetflow_pl.runtime.loader import ENGINE_KINDS, load_backend, resolve_kind

    check_device(args.device)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    kind = resolve_kind(args.backend or ("onnxruntime" if args.engine_dir is not None else "torch"))
    # an engine directory alone is enough (graphs, config, tokenizer); no head is made for it
    target, head, tokenizer = load_models(args, kind, note=log.warning)
    if kind in ENGINE_KINDS:
        backend = load_backend(
            kind,
            engine_dir=args.engine_dir,
            device=args.device if kind == "tensorrt" else None,
            intra_op_threads=args.threads,
        )
    elif kind == "torch":
        from jetflow_pl.runtime.torch_backend import TorchBackend

        backend = TorchBackend(target, head, max_batch=args.max_batch)
    else:
        backend = load_backend(kind, target=target, head=head, device=args.device, topk=max(8, args.width))
    name = args.served_model_name or (args.engine_dir if kind in ENGINE_KINDS else args.target).resolve().name
    try:
        backend.check_width(args.width)
    except ValueError as err:
        raise UserInputError(str(err)) from err
    gen = SpeculativeGenerator(backend, budget_policy(args), args.width, eos_token_id=tokenizer.eos_token_id)
    return gen, tokenizer, name


def make_app(args: argparse.Namespace):
    """The FastAPI app (and its driver) the flags describe."""
    from jetflow_pl.serve.app import ServeConfig, create_app
    from jetflow_pl.serve.driver import EngineDriver

    gen, tokenizer, name = load_server_parts(args)
    max_batch = min(args.max_batch, int(gen.backend.max_batch))
    if max_batch < args.max_batch:
        log.warning(
            "%s decodes at most %d request(s) at a time: --max-batch %d -> %d",
            type(gen.backend).__name__,
            max_batch,
            args.max_batch,
            max_batch,
        )
    driver = EngineDriver.for_generator(
        gen,
        max_batch=max_batch,
        prefill_chunk=args.prefill_chunk,
        max_kv_tokens=args.max_kv_tokens,
        max_queue=args.max_queue,
    )
    config = ServeConfig(
        model_name=name,
        context_window=int(gen.backend.max_positions),
        max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=args.default_max_tokens,
        retry_after_s=args.retry_after,
    )
    return create_app(driver, tokenizer, config)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        print(
            "error: jetflow-serve needs fastapi and uvicorn: pip install 'jetflow-pl[serve]'", file=sys.stderr
        )
        return 2
    try:
        app = make_app(args)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NumericalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
