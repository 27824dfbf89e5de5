"""`python -m jetflow_pl draft-vocab`: give a trained head a draft vocabulary from its training data.

Counts the response tokens of one or more regenerated datasets (the tokens the head was trained to
draft), keeps the `--size` most frequent (plus the head's EOS / pad ids) and writes a copy of the head
that drafts from those only (`jetflow_pl.head.draft_vocab`). Training-free and lossless: the target
still verifies over its full vocabulary. Prints the coverage (share of the counted tokens inside the
set); `draft_vocab.json` beside the new head records it with the sources.

    python -m jetflow_pl draft-vocab --head heads/smollm2-135m-instruct \\
        --data runs/regenerate/smollm2/dataset --size 8192 --out runs/heads/smollm2-vd8192
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.errors import UserInputError
from jetflow_pl.head.draft_vocab import (
    count_tokens,
    coverage,
    keep_ids,
    load_token_sequences,
    select_draft_vocab,
    set_draft_vocab,
)

#: files of a head folder that stay true for the copy (provenance); an acceptance profile does not:
#: it was measured drafting over the full vocabulary
CARRIED_FILES = ("training_config.yaml",)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m jetflow_pl draft-vocab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--head", type=Path, required=True, help="trained head folder (HF format)")
    ap.add_argument(
        "--data",
        type=Path,
        nargs="+",
        required=True,
        help="regenerated dataset folder(s) (datasets.load_from_disk) or folders of parquet shards",
    )
    ap.add_argument("--size", type=int, required=True, help="number of token ids the head drafts from")
    ap.add_argument("--out", type=Path, required=True, help="folder for the head with its draft vocabulary")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.out.resolve() == args.head.resolve():
        print("error: --out must differ from --head (the original head stays as it is)", file=sys.stderr)
        return 2
    try:
        head = load_draft_head(args.head)
        vocab_size = int(head.config.vocab_size)
        sequences = [seq for path in args.data for seq in load_token_sequences(path)]
        rows = len(sequences)
        counts = count_tokens(sequences, vocab_size)
        if int(counts.sum()) == 0:
            raise UserInputError(f"no response tokens in {', '.join(map(str, args.data))}")
        vocab = select_draft_vocab(counts, args.size, keep=keep_ids(head.config))
    except (ValueError, FileNotFoundError, UserInputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    set_draft_vocab(head, vocab)
    share = coverage(counts, vocab)
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    head.save_pretrained(tmp)
    for name in CARRIED_FILES:
        if (args.head / name).exists():
            shutil.copy2(args.head / name, tmp / name)
    record = {
        "source_head": str(args.head),
        "data": [str(p) for p in args.data],
        "rows": rows,
        "tokens": int(counts.sum()),
        "distinct_tokens": int((counts > 0).sum()),
        "draft_vocab_size": int(vocab.numel()),
        "vocab_size": vocab_size,
        "coverage": round(share, 6),
    }
    (tmp / "draft_vocab.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    print(
        f"{args.out}: drafts from {vocab.numel()} of {vocab_size} ids, covering {share:.2%} of "
        f"{int(counts.sum())} response tokens ({rows} rows)"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    torch.set_grad_enabled(False)
    sys.exit(main())
