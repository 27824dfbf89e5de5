"""`jetflow-export`: the export command line.

The ONNX / TensorRT export itself is not implemented yet (it is the next stage of the roadmap). Until
then this command parses its future flags, prints help, and refuses to run with a non-zero exit status
rather than pretending to produce an engine directory.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jetflow-export",
        description=(
            "Export a draft head and its target to ONNX graphs (and TensorRT engines with --engine). "
            "NOT IMPLEMENTED YET: this release only reserves the command and its flags."
        ),
    )
    parser.add_argument("--head", help="draft head directory (HF format)")
    parser.add_argument("--target", help="target model directory (HF format)")
    parser.add_argument("--out", help="engine directory to write")
    parser.add_argument("--variant", choices=["plugin", "portable"], default="plugin")
    parser.add_argument("--opset", type=int, default=None)
    parser.add_argument("--engine", action="store_true", help="also build TensorRT engines")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    print(
        "jetflow-export: export is not implemented in this release; no files were written.",
        file=sys.stderr,
    )
    return 2


def console_main() -> None:
    """Console-script wrapper: exit with `main`'s status."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
