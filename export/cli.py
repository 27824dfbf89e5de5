"""`jetflow-export`: write an engine directory (ONNX graphs, config, tokenizer) for a head + target pair.

    jetflow-export --head runs/quickstart/head/best --target data_gen/toy/assets/small --out engines/toy

User errors (bad paths, a head that does not fit its target, an existing output folder) print one
`error:` line and exit with status 2; nothing is written in that case.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from jetflow_pl.errors import UserInputError
from jetflow_pl.runtime.contract import VARIANTS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jetflow-export",
        description="Export a draft head and its target to ONNX graphs (and TensorRT engines with --engine).",
    )
    parser.add_argument("--head", required=True, type=Path, help="draft head directory (HF format)")
    parser.add_argument("--target", required=True, type=Path, help="target model directory (HF format)")
    parser.add_argument("--out", required=True, type=Path, help="engine directory (or head folder) to write")
    parser.add_argument(
        "--format",
        choices=("onnx", "vllm", "sglang", "jetspec", "llamacpp"),
        default="onnx",
        help="onnx (default): the engine directory of this runtime (ONNX graphs, TensorRT with --engine); "
        "vllm / sglang / jetspec / llamacpp: the head as that engine's DFlash loader reads it (docs/SCALE_OUT.md)",
    )
    parser.add_argument(
        "--full-vocab",
        action="store_true",
        help="--format sglang/jetspec: write a head with a draft vocabulary anyway (those engines draft over "
        "every id; without this flag such a head is refused)",
    )
    parser.add_argument(
        "--variant",
        choices=VARIANTS,
        default=None,
        help="portable (default without --engine): standard ONNX ops, the fast path on ONNX Runtime; plugin "
        "(default with --engine): TreeAttention nodes for the TensorRT plugin (on ONNX Runtime a slow "
        "Python op); attention: opset-23 Attention nodes (plugin-free TensorRT IAttention path)",
    )
    parser.add_argument(
        "--opset", type=int, default=None, help="ONNX opset (default 20; 23 for --variant attention)"
    )
    parser.add_argument("--topk", type=int, default=8, help="draft tokens kept per depth (max tree width)")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="1 (default): batch-1 graphs (what --engine builds from); N > 1: batched graphs (dynamic batch "
        "axis, per-request KV lengths and packed masks) whose runtimes open N request slots by default",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--engine", action="store_true", help="also build TensorRT engines (needs TensorRT)")
    parser.add_argument("--plugin-lib", type=Path, default=None, help="TreeAttention plugin .so for --engine")
    parser.add_argument(
        "--precision", choices=["fp16", "bf16", "fp32"], default="fp16", help="--engine precision"
    )
    parser.add_argument(
        "--max-tree", type=int, default=256, help="--engine profile: most tree nodes per verify"
    )
    parser.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="--engine profile: most cached rows (default: max positions)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="only print errors")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    if args.quiet:  # only errors: no weight-loading progress bars from transformers either
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if args.variant is None:  # the variant that runs best where the engine will run
        args.variant = "plugin" if args.engine else "portable"
    try:
        if args.format != "onnx":
            return _write_engine_folder(args)
        plugin = None
        if args.engine and args.max_batch > 1:
            raise UserInputError(
                "--engine builds TensorRT engines from the batch-1 graphs (the TensorRT backend decodes one "
                "request per forward): drop --max-batch, or export the batched graphs without --engine"
            )
        if args.engine:
            # fail before the (slow) ONNX export, and before importing the export stack, when TensorRT
            # cannot run here or the plugin library is missing
            from export.tensorrt_build import require_tensorrt

            plugin = require_tensorrt(args.plugin_lib, variant=args.variant)
        from export.onnx_export import ExportSettings, export_engine

        settings = ExportSettings(
            head=args.head,
            target=args.target,
            out=args.out,
            variant=args.variant,
            opset=args.opset,
            topk=args.topk,
            overwrite=args.overwrite,
            max_batch=args.max_batch,
        )
        out = export_engine(settings)
        if args.engine:
            from export.tensorrt_build import EngineBuildError, build_engines

            try:
                build_engines(
                    out,
                    plugin_lib=plugin,
                    precision=args.precision,
                    max_tree=args.max_tree,
                    max_context=args.max_context,
                )
            except EngineBuildError as err:
                raise UserInputError(
                    f"TensorRT engine build failed (the ONNX graphs in {out} are kept): {err}"
                ) from err
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"engine directory written: {out}")
    backend = "tensorrt --device cuda" if args.engine else "onnxruntime"
    print(f"serve it with:\n  jetflow-serve --engine-dir {out} --backend {backend}")
    print(
        "the head on vLLM / SGLang / llama.cpp: jetflow-export --format vllm|sglang|llamacpp (docs/SCALE_OUT.md)"
    )
    return 0


def _write_engine_folder(args: argparse.Namespace) -> int:
    """`--format vllm|sglang|jetspec|llamacpp`: the head folder for that engine, and the command that serves it."""
    if args.engine:
        raise UserInputError(
            f"--engine builds TensorRT engines from ONNX graphs: drop it with --format {args.format}"
        )
    from export.engine_folder import EngineFolderSettings, write_engine_folder

    command = write_engine_folder(
        EngineFolderSettings(
            head=args.head,
            target=args.target,
            out=args.out,
            engine=args.format,
            full_vocab=args.full_vocab,
            overwrite=args.overwrite,
        )
    )
    print(f"{args.format} head folder written: {args.out}\nserve it with:\n  {command}")
    return 0


def console_main() -> None:
    """Console-script wrapper: exit with `main`'s status."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
