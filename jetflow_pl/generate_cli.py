"""`python -m jetflow_pl generate` / `jetflow-generate`: speculative decoding from the command line.

Prints the generated text and the metrics of DESIGN.md: tau (tokens per target verify forward), decode
tokens/s (prefill excluded) and, with `--compare`, the speedup over the AR loop on the same backend and
over HF `generate()`, measured in the same run on the same machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from data_gen.toy.tokenizer import mask_token_id, prompt_ids
from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.decoding import ARGenerator, SamplingConfig, SpeculativeGenerator
from jetflow_pl.decoding.torch_backend import TorchBackend
from jetflow_pl.errors import MissingPathError, NumericalError, UserInputError
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import Top2GapCap


def _int_at_least(lo: int):
    """An argparse type: an int >= lo, so `--budget -1` fails at parse time naming the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    return parse


def _float_in(lo: float, hi: float, lo_open: bool = False):
    """An argparse type: a float in [lo, hi] ((lo, hi] with lo_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (lo < value if lo_open else lo <= value) or not value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jetflow-generate", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, type=Path, help="target model directory (HF format)")
    p.add_argument("--head", type=Path, default=None, help="draft head directory; omitted = untrained head")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompts-file", type=Path, default=None, help="a text file with one prompt per line")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts raw, without the template")
    p.add_argument(
        "--budget", type=_int_at_least(0), default=64, help="draft tokens per tree (root excluded); 0 = AR"
    )
    p.add_argument("--width", type=_int_at_least(1), default=4, help="children per expanded node")
    p.add_argument(
        "--gap-cap",
        type=_float_in(0.0, float("inf")),
        default=None,
        help="one child where top1-top2 logprob gap > this",
    )
    p.add_argument("--max-new-tokens", type=_int_at_least(0), default=128)
    p.add_argument("--temperature", type=_float_in(0.0, float("inf")), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=_int_at_least(0), default=0)
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--backend",
        choices=["torch", "graph", "onnxruntime"],
        default="torch",
        help="torch: HF target + head; graph: the decode graphs eagerly in torch (tree-attention op, Triton "
        "on CUDA); onnxruntime: an exported engine directory (--engine-dir)",
    )
    p.add_argument("--engine-dir", type=Path, default=None, help="engine directory for --backend onnxruntime")
    p.add_argument("--compare", action="store_true", help="also time AR decoding and HF generate()")
    p.add_argument("--json", type=Path, default=None, help="write per-prompt metrics to this JSON file")
    return p


def load_head_or_untrained(head_dir: Path | None, target: TargetModel, tokenizer) -> DraftHead:
    """The head saved in `head_dir`, or (None) a seeded random head fitted to `target` and the toy mask token.

    A random head drafts badly but decoding stays exact: it shows the loop's floor, not the method.
    """
    if head_dir is not None:
        return load_draft_head(head_dir)
    torch.manual_seed(0)
    return DraftHead(DraftHeadConfig.for_target(target.config, mask_token_id=mask_token_id(tokenizer)))


def _encode(tokenizer, text: str, chat: bool) -> list[int]:
    if chat and tokenizer.chat_template:
        return prompt_ids(tokenizer, text)
    return tokenizer(text)["input_ids"]


def _hf_decode_tokens_per_s(model, ids: list[int], max_new: int, eos) -> tuple[list[int], float]:
    """HF greedy generate(); decode time = full call minus a 1-token call (its prefill)."""
    x = torch.tensor([ids], device=model.device)
    kw = {"do_sample": False, "eos_token_id": eos, "pad_token_id": eos if eos is not None else 0}
    t0 = time.perf_counter()
    model.generate(x, max_new_tokens=1, **kw)
    t1 = time.perf_counter()
    out = model.generate(x, max_new_tokens=max_new, **kw)[0, len(ids) :].tolist()
    t2 = time.perf_counter()
    decode = (t2 - t1) - (t1 - t0)
    return out, (len(out) - 1) / decode if decode > 0 and len(out) > 1 else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags (bad flags exit 2 naming the flag) and run; user and numerical errors are one line."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NumericalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserInputError(f"cannot load a tokenizer from {path}: {type(err).__name__}: {err}") from err


def _check_device(name: str) -> None:
    """Refuse a device this machine lacks before minutes of model loading, not after."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UserInputError(f"--device {name!r} is not a torch device ({err})") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserInputError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")


def _backends(args: argparse.Namespace, target: TargetModel, head: DraftHead):
    """(speculative backend, AR backend): AR runs on the same kind of backend, so speedups compare like
    with like (DESIGN.md section 4)."""
    if args.backend == "torch":
        return TorchBackend(target, head), TorchBackend(target)
    if args.backend == "graph":
        from jetflow_pl.decoding.graph_backend import TorchGraphBackend

        backend = TorchGraphBackend(target, head, topk=max(8, args.width))
        return backend, backend
    if args.engine_dir is None:
        raise UserInputError("--backend onnxruntime needs --engine-dir DIR (written by jetflow-export)")
    from jetflow_pl.decoding.ort_backend import OnnxRuntimeBackend

    try:
        backend = OnnxRuntimeBackend(args.engine_dir)
    except (FileNotFoundError, ValueError) as err:
        raise UserInputError(str(err)) from err
    try:
        backend.check_width(args.width)
    except ValueError as err:
        raise UserInputError(str(err)) from err
    return backend, backend


def _run(args: argparse.Namespace) -> int:
    _check_device(args.device)
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise MissingPathError(f"--prompts-file {args.prompts_file} does not exist")
        prompts += [ln for ln in args.prompts_file.read_text().splitlines() if ln.strip()]
    if not prompts:
        print("jetflow-generate: give at least one --prompt or --prompts-file", file=sys.stderr)
        return 2
    target = TargetModel.from_pretrained(args.target, device=args.device)
    tokenizer = _load_tokenizer(args.target)
    target.check_tokenizer(tokenizer)
    if args.head is None:
        print("note: no --head given; drafting with an untrained (random) head", file=sys.stderr)
    head = load_head_or_untrained(args.head, target, tokenizer).to(args.device)
    try:
        head.check_compatible(target.config)  # before any decoding, naming every mismatched field
    except ValueError as err:
        raise UserInputError(f"{args.head}: {err}") from err
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    eos = tokenizer.eos_token_id
    policy = Top2GapCap(args.gap_cap) if args.gap_cap is not None else None
    backend, ar_backend = _backends(args, target, head)
    spec = SpeculativeGenerator(backend, args.budget, args.width, policy, eos)
    ar = ARGenerator(ar_backend, eos) if args.compare else None

    rows = []
    for text in prompts:
        ids = _encode(tokenizer, text, chat=not args.no_chat_template)
        res = spec.generate(ids, args.max_new_tokens, sampling)
        row = {
            "prompt": text,
            "output": tokenizer.decode(res.tokens, skip_special_tokens=True),
            "new_tokens": len(res.tokens),
            "tau": res.tau,
            "decode_tokens_per_s": res.decode_tokens_per_s,
        }
        print(f"\n>>> {text}\n{row['output']}")
        line = f"[tau {res.tau:.2f} | {res.decode_tokens_per_s:.1f} tok/s decode"
        if ar is not None:
            ar_res = ar.generate(ids, args.max_new_tokens, sampling)
            hf_tokens, hf_tps = _hf_decode_tokens_per_s(target.model, ids, args.max_new_tokens, eos)
            row["ar_decode_tokens_per_s"] = ar_res.decode_tokens_per_s
            row["hf_decode_tokens_per_s"] = hf_tps
            row["speedup_vs_ar"] = res.decode_tokens_per_s / max(ar_res.decode_tokens_per_s, 1e-9)
            row["speedup_vs_hf"] = res.decode_tokens_per_s / max(hf_tps, 1e-9)
            if sampling.greedy:
                row["matches_hf_greedy"] = hf_tokens == res.tokens
            line += f" | x{row['speedup_vs_ar']:.2f} vs AR | x{row['speedup_vs_hf']:.2f} vs HF generate"
            if "matches_hf_greedy" in row:
                line += f" | identical to HF greedy: {row['matches_hf_greedy']}"
        print(line + "]")
        rows.append(row)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
