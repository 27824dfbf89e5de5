"""`python -m jetflow_pl evaluate`: a head's acceptance and speed on prompt sets, per category and budget.

    python -m jetflow_pl evaluate --target models/SmolLM2-135M-Instruct \\
        --head heads/smollm2-135m-instruct --prompts mtbench --budget 16 --budget auto --out runs/eval

Prompt sources (`--prompts`, repeatable): the named sets `mtbench[:<categories>[:<n per category>]]` and
`sharegpt:<split>[:<n>]` (`jetflow_pl/prompt_sets.py`), or a local JSONL/JSON/CSV/Parquet file or
`datasets` folder with a `prompt`, `messages` or `turns` column. Every conversation is answered turn by turn
(`--turns`, default 2: MT-Bench's second turn follows the target's own first answer). Several `--head`s
(torch backends) or `--engine-dir`s (onnxruntime / tensorrt; enough alone: an engine directory holds the
graphs, config and tokenizer, so `--target` may be left out) are measured side by side against the same AR.

Prints the table and writes `<out>/evaluate.json` (settings, table, per-turn records; no prompt text),
`<out>/evaluate.md` (the table in Markdown) and `<out>/evaluate.png`. Exits 1 when any output differs from AR (the lossless check), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from jetflow_pl.decode_options import (
    acceptance_prior,
    add_cost_profile_arguments,
    add_threads_argument,
    auto_budget,
    check_device,
    decode_target,
    int_at_least,
    load_backends,
    load_checked_head,
    parse_budget,
)
from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
from jetflow_pl.errors import NumericalError, UserInputError
from jetflow_pl.evaluation import (
    AR_LABEL,
    DecodeConfig,
    conversations_from_rows,
    evaluate_conversations,
    format_markdown,
    format_table,
    plot_table,
    summarize,
    timestamp,
)
from jetflow_pl.prompt_sets import load_prompt_rows
from jetflow_pl.runtime.loader import BACKEND_KINDS, ENGINE_KINDS, resolve_kind
from jetflow_pl.target import TargetModel


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jetflow_pl evaluate", description=__doc__.splitlines()[0])
    p.add_argument(
        "--target",
        type=Path,
        default=None,
        help="target model directory (HF format; tokenizer); optional with --engine-dir, which holds the "
        "graphs, config and tokenizer",
    )
    p.add_argument(
        "--head",
        action="append",
        default=[],
        help="draft head directory, optionally LABEL=DIR (repeatable: heads side by side; torch backends)",
    )
    p.add_argument(
        "--engine-dir",
        action="append",
        default=[],
        help="engine directory from jetflow-export, optionally LABEL=DIR (repeatable; onnxruntime/tensorrt)",
    )
    p.add_argument(
        "--backend",
        choices=[*BACKEND_KINDS, "graph"],
        default=None,
        help="torch (default without --engine-dir: HF target + head), torch-graph, onnxruntime (default "
        "with --engine-dir) or tensorrt (these two need --engine-dir)",
    )
    p.add_argument(
        "--prompts",
        action="append",
        default=[],
        help="a prompt source (repeatable): mtbench[:CATS[:N]], sharegpt:SPLIT[:N], or a local file/folder",
    )
    p.add_argument(
        "--max-per-category",
        type=int_at_least(1),
        default=None,
        help="at most N conversations per category of each source (e.g. for a local file)",
    )
    p.add_argument(
        "--skip-per-category",
        type=int_at_least(0),
        default=0,
        help="pass over the first N conversations of each category (e.g. prompts a head was selected on)",
    )
    p.add_argument("--turns", type=int_at_least(1), default=2, help="user turns answered per conversation")
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="a base model: continue each first user turn as plain text (implies one turn)",
    )
    p.add_argument(
        "--budget",
        action="append",
        type=parse_budget,
        default=[],
        help="draft budget (repeatable; an integer >= 1 or auto); default: 16 and auto",
    )
    p.add_argument("--width", type=int_at_least(1), default=4, help="children per expanded node")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=128, help="new tokens per turn")
    p.add_argument(
        "--max-context",
        type=int_at_least(2),
        default=None,
        help="skip turns whose prompt + max-new-tokens exceed this (default: the target's context)",
    )
    p.add_argument("--repeats", type=int_at_least(1), default=1, help="timed passes over every turn")
    add_cost_profile_arguments(p)
    p.add_argument("--device", default="cpu")
    add_threads_argument(p)
    p.add_argument("--out", type=Path, default=Path("runs/evaluate"), help="folder for evaluate.json/.png")
    p.add_argument("--no-plot", action="store_true", help="skip the plot")
    p.add_argument(
        "--save-acceptance-profile",
        type=Path,
        default=None,
        help="write the acceptance of the first head's largest fixed budget (and every ladder budget below "
        "it) as a `--budget auto` prior, e.g. HEAD/acceptance_profile.json; calibrate on prompts you do "
        "not report on",
    )
    return p


def labelled(text: str) -> tuple[str, Path]:
    """`LABEL=DIR` or `DIR` (the label is then the folder's name, with its parent for `best` / `last`)."""
    if "=" in text and "/" not in text.split("=", 1)[0]:
        label, path = text.split("=", 1)
        return label, Path(path)
    path = Path(text)
    label = f"{path.parent.name}/{path.name}" if path.name in ("best", "last") else path.name
    return label, path


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return run(args)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NumericalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def _load_conversations(args: argparse.Namespace) -> tuple[list, list[dict]]:
    if not args.prompts:
        raise UserInputError("give at least one --prompts source (e.g. --prompts mtbench)")
    conversations, reports = [], []
    for spec in args.prompts:
        rows, report = load_prompt_rows(spec, split="test")
        name = spec.split(":", 1)[0].split("@", 1)[0] if report is not None else Path(spec).stem
        convs = conversations_from_rows(rows, name, args.turns, args.max_per_category, args.skip_per_category)
        if not convs:
            raise UserInputError(f"--prompts {spec!r} selects no conversation")
        conversations += convs
        reports.append(
            {"spec": spec, "conversations": len(convs), **({"report": report.to_dict()} if report else {})}
        )
        print(f"[evaluate] {spec}: {len(convs)} conversations" + (f" ({report.summary()})" if report else ""))
    return conversations, reports


def _configs(
    args: argparse.Namespace, target: TargetModel | None, tokenizer
) -> tuple[DecodeConfig, list[DecodeConfig]]:
    """AR on the backend's own kind, and one speculative configuration per (head or engine, budget)."""
    kind = resolve_kind(args.backend)
    eos = tokenizer.eos_token_id
    budgets = args.budget or [16, "auto"]
    if 0 in budgets:
        raise UserInputError("--budget 0 is AR, which every run measures anyway: give budgets >= 1 or auto")
    if kind in ENGINE_KINDS:
        if not args.engine_dir or args.head:
            raise UserInputError(f"--backend {args.backend} takes --engine-dir DIR (not --head)")
        sources = [(label, None, path) for label, path in map(labelled, args.engine_dir)]
    else:
        if args.engine_dir:
            raise UserInputError(f"--engine-dir is for onnxruntime / tensorrt, not --backend {args.backend}")
        if not args.head:
            print("note: no --head given; drafting with an untrained (random) head", file=sys.stderr)
        sources = [(label, path, None) for label, path in map(labelled, args.head)] or [
            ("untrained", None, None)
        ]
    configs, ar_backend = [], None
    for label, head_dir, engine_dir in sources:
        for folder in (head_dir, engine_dir):
            if folder is not None and not folder.is_dir():
                raise UserInputError(f"{folder} is not a folder")
        head = None if kind in ENGINE_KINDS else load_checked_head(head_dir, target, tokenizer, args.device)
        # the one backend set-up of the decoding commands, for this head or engine
        backend, own_ar = load_backends(
            argparse.Namespace(**{**vars(args), "engine_dir": engine_dir}), target, head
        )
        ar_backend = ar_backend or own_ar
        for budget in budgets:
            policy = budget
            if budget == "auto":
                prior = acceptance_prior(
                    argparse.Namespace(
                        acceptance_profile=None, head=head_dir, engine_dir=engine_dir, width=args.width
                    )
                )
                policy = auto_budget(args, prior)
            gen = SpeculativeGenerator(backend, policy, args.width, None, eos)
            vocab = getattr(head, "draft_vocab", None) if head is not None else None
            vocab = frozenset(int(i) for i in vocab.tolist()) if vocab is not None else None
            configs.append(
                DecodeConfig(
                    f"{label}@{budget}", gen.generate, budget, str(head_dir or engine_dir), gen, vocab
                )
            )
    ar = ARGenerator(ar_backend, eos)
    return DecodeConfig(AR_LABEL, ar.generate), configs


def run(args: argparse.Namespace) -> int:
    check_device(args.device)
    if args.backend is None:
        args.backend = "onnxruntime" if args.engine_dir else "torch"
    if args.no_chat_template:
        args.turns = 1
    conversations, reports = _load_conversations(args)
    # an engine backend needs no target model (the graphs hold it); the tokenizer is then the first
    # engine directory's unless --target is given
    kind = resolve_kind(args.backend)
    first_engine = labelled(args.engine_dir[0])[1] if args.engine_dir and kind in ENGINE_KINDS else None
    target, tokenizer = decode_target(
        args.target, first_engine, kind, device=args.device, need_target=kind not in ENGINE_KINDS
    )
    ar, configs = _configs(args, target, tokenizer)
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise UserInputError(f"two configurations share a label ({labels}): name them with LABEL=DIR")
    # warm-up (not recorded): first-call allocations and, for `auto`, its cost profile, off the clock
    warm = tokenizer("Hello", add_special_tokens=False)["input_ids"] or [int(tokenizer.eos_token_id or 0)]
    for cfg in [ar, *configs]:
        cfg.generate(warm, 8)
        if cfg.generator is not None:  # the profile saved at the end counts the measured turns only
            cfg.acceptance = cfg.generator.record_acceptance()
    from tqdm.auto import tqdm

    total = sum(1 + len(c.later) for c in conversations)
    bar = tqdm(total=total, desc="evaluate", unit="turn", file=sys.stderr)
    records, skipped = evaluate_conversations(
        conversations,
        ar,
        configs,
        tokenizer,
        stop_ids=sorted(ar_stop_ids(tokenizer)),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        max_context=args.max_context or _context_window(target, configs),
        on_turn=lambda rec: bar.update(1),
        chat=not args.no_chat_template,
    )
    bar.close()
    if not records:
        raise UserInputError(f"no turn fits --max-context ({dict(skipped)})")
    table = summarize(records, labels, args.repeats)
    print(format_table(table))
    if skipped:
        print(f"[evaluate] skipped turns: {dict(skipped)}")
    mismatches = sum(r["mismatches"] for r in table if r["group"] == "all")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python -m jetflow_pl evaluate " + " ".join(getattr(args, "argv", [])),
        "date": timestamp(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "threads": torch.get_num_threads(),
        },
        "settings": {
            "target": None if args.target is None else str(args.target),
            "backend": resolve_kind(args.backend),
            "configs": [{"label": c.label, "budget": c.budget, "head": c.head} for c in configs],
            "width": args.width,
            "max_new_tokens": args.max_new_tokens,
            "turns": args.turns,
            "repeats": args.repeats,
            "device": args.device,
        },
        "sources": reports,
        "skipped_turns": dict(skipped),
        "lossless": mismatches == 0,
        "table": table,
        "records": [r.to_dict() for r in records],
    }
    (args.out / "evaluate.json").write_text(json.dumps(result, indent=1))
    (args.out / "evaluate.md").write_text(format_markdown(table) + "\n")
    if not args.no_plot:
        plot_table(table, args.out / "evaluate.png")
    print(
        f"[evaluate] wrote {args.out / 'evaluate.json'}"
        + ("" if args.no_plot else f" and {args.out / 'evaluate.png'}")
    )
    if args.save_acceptance_profile is not None:
        save_prior(configs, args, sum(1 for _ in records))
    if mismatches:
        print(f"error: {mismatches} outputs differ from AR (lossless check failed)", file=sys.stderr)
        return 1
    return 0


def _context_window(target: TargetModel | None, configs: Sequence[DecodeConfig]) -> int:
    """The target's context, or (an engine backend without a target) the smallest of the engines'."""
    if target is not None:
        return int(target.config.max_position_embeddings)
    return min(int(c.generator.backend.max_positions) for c in configs)


def save_prior(configs: Sequence[DecodeConfig], args: argparse.Namespace, turns: int) -> None:
    """The acceptance seen at the first head's largest fixed budget, as an `AcceptanceProfile` file."""
    fixed = [c for c in configs if isinstance(c.budget, int) and c.generator is not None]
    if not fixed:
        raise UserInputError("--save-acceptance-profile needs a fixed --budget (e.g. --budget 16)")
    first_head = fixed[0].head
    best = max((c for c in fixed if c.head == first_head), key=lambda c: c.budget)
    note = f"python -m jetflow_pl evaluate, budget {best.budget}, {turns} turns of {', '.join(args.prompts)}"
    try:
        profile = best.acceptance.to_profile(args.width, note=note)
    except ValueError as err:
        raise UserInputError(f"--save-acceptance-profile: {err}") from err
    profile.save(args.save_acceptance_profile)
    print(f"[evaluate] acceptance profile of {best.label} written to {args.save_acceptance_profile}")


def ar_stop_ids(tokenizer) -> set[int]:
    """The ids a generated answer may end with (the tokenizer's EOS), for continuing a conversation."""
    eos = tokenizer.eos_token_id
    return {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}


if __name__ == "__main__":
    sys.exit(main())
