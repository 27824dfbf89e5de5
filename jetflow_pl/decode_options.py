"""What the decoding commands (`generate`, `evaluate`, `serve`) set up from their flags, in one place: the
flag types, the target and tokenizer (`--target`'s, or an engine directory's alone), the head (or a seeded
untrained one; none on an engine backend, whose graphs hold it), the speculative and AR backends of
`--backend`, and the `--budget` policy (a fixed budget, or `auto` with the head's acceptance prior).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.decoding.budget import ACCEPTANCE_PROFILE_FILE, AcceptanceProfile, AutoBudget
from jetflow_pl.errors import MissingPathError, UserInputError
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.runtime.contract import TOKENIZER_DIR
from jetflow_pl.runtime.engine_config import load_engine_config
from jetflow_pl.runtime.loader import ENGINE_KINDS, load_backend, resolve_kind
from jetflow_pl.target import TargetModel


def int_at_least(lo: int):
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


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """`--threads N` (generate and serve): torch's threads and ONNX Runtime's intra-op pool, which keeps
    its own size whatever torch's is; `load_backends` / the server pass it to `load_backend`."""
    p.add_argument(
        "--threads",
        type=int_at_least(1),
        default=None,
        help="CPU threads: torch's and ONNX Runtime's intra-op pool (default: each one's own; on a small "
        "CPU one ORT thread can make tree rounds cheaper, docs/DISTILLATION.md)",
    )


def parse_budget(text: str) -> int | str:
    """An argparse type: `auto` or an int >= 0 (the messages name the flag, as `int_at_least`'s do)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r} (or 'auto')") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def float_in(lo: float, hi: float, lo_open: bool = False):
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


def load_head_or_untrained(head_dir: Path | None, target: TargetModel, tokenizer) -> DraftHead:
    """The head saved in `head_dir`, or (None) a seeded random head fitted to `target` whose mask id is
    the tokenizer's mask token. The mask id of a saved head is its config's (`dflash_config`).

    A random head drafts badly but decoding stays exact: it shows the loop's floor, not the method.
    """
    if head_dir is not None:
        return load_draft_head(head_dir)
    mask = getattr(tokenizer, "mask_token_id", None)
    if mask is None:
        raise UserInputError(
            "no --head given and the tokenizer defines no mask token for an untrained head: pass --head DIR"
        )
    torch.manual_seed(0)
    return DraftHead(DraftHeadConfig.for_target(target.config, mask_token_id=int(mask)))


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserInputError(f"cannot load a tokenizer from {path}: {type(err).__name__}: {err}") from err


def engine_tokenizer(engine_dir: Path):
    """The tokenizer an engine directory carries: `jetflow-export` copies the target's (its EOS ids and chat
    template with it) into the folder `config.json` names. One error when the folder is no engine directory,
    or when it has no tokenizer (an export from before the tokenizer was copied)."""
    try:
        config = load_engine_config(engine_dir)
    except FileNotFoundError as err:
        raise MissingPathError(str(err)) from err
    except ValueError as err:
        raise UserInputError(str(err)) from err
    folder = Path(engine_dir) / str(config.get("tokenizer") or TOKENIZER_DIR)
    if not (folder / "tokenizer.json").is_file():
        raise UserInputError(
            f"engine directory {engine_dir} carries no tokenizer ({folder}/tokenizer.json; an older export): "
            "pass --target DIR (the target it was exported from) or re-export it with jetflow-export"
        )
    return load_tokenizer(folder)


def decode_target(
    target_dir: Path | None, engine_dir: Path | None, kind: str, *, device: str, need_target: bool
) -> tuple[TargetModel | None, object]:
    """(target, tokenizer) of a decode on backend `kind` (a `resolve_kind` name).

    Engine kinds (onnxruntime, tensorrt): `engine_dir` holds the graphs (the head's among them), config and
    tokenizer, so it is enough alone: the tokenizer is then the engine's and no target loads. With
    `target_dir` too the tokenizer is the target's (as before), and the HF target loads only when
    `need_target` (what runs the HF model itself: `generate --compare`'s HF generate(), checking a --head).
    Torch kinds: the target and its tokenizer, checked against each other.
    """
    if kind in ENGINE_KINDS:
        if engine_dir is None:
            raise UserInputError(f"--backend {kind} needs --engine-dir DIR (written by jetflow-export)")
        if target_dir is None:
            return None, engine_tokenizer(engine_dir)
        if not Path(engine_dir).is_dir():
            raise MissingPathError(f"engine directory does not exist: {engine_dir}")
        if not need_target:
            if not Path(target_dir).is_dir():
                raise MissingPathError(f"--target {target_dir} does not exist")
            return None, load_tokenizer(target_dir)
    elif target_dir is None:
        raise UserInputError(
            f"--backend {kind} needs --target DIR (or decode an --engine-dir on onnxruntime / tensorrt)"
        )
    target = TargetModel.from_pretrained(target_dir, device=device)
    tokenizer = load_tokenizer(target_dir)
    target.check_tokenizer(tokenizer)
    return target, tokenizer


def _stderr_note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def load_models(
    args: argparse.Namespace,
    kind: str,
    *,
    need_target: bool = False,
    note: Callable[[str], None] = _stderr_note,
) -> tuple[TargetModel | None, DraftHead | None, object]:
    """(target, head, tokenizer) of `--target`, `--head` and `--engine-dir` for backend `kind` (generate,
    serve). Engine kinds: `decode_target`, and no head (the graphs hold it: an untrained head would need
    a mask token a chat tokenizer may not have); a `--head` is still checked against `--target` (its
    folder's acceptance prior is `--budget auto`'s) and needs it. Torch kinds: the target, and `--head`
    or a seeded untrained head (with a `note`)."""
    engine = kind in ENGINE_KINDS
    target, tokenizer = decode_target(
        args.target,
        args.engine_dir,
        kind,
        device=args.device,
        need_target=need_target or args.head is not None,
    )
    if engine and args.head is None:
        return target, None, tokenizer
    if engine and target is None:
        raise UserInputError("--head needs --target (an engine directory carries its own head graph)")
    if args.head is None:
        note("no --head given; drafting with an untrained (random) head")
    return target, load_checked_head(args.head, target, tokenizer, args.device), tokenizer


def check_device(name: str) -> None:
    """Refuse a device this machine lacks before minutes of model loading, not after."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UserInputError(f"--device {name!r} is not a torch device ({err})") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserInputError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")


def load_checked_head(head_dir: Path | None, target: TargetModel, tokenizer, device: str) -> DraftHead:
    """`load_head_or_untrained` on `device`, refused in one line (naming every mismatched field) when it
    does not fit `target`: before any decoding, not at the first draft."""
    head = load_head_or_untrained(head_dir, target, tokenizer).to(device)
    try:
        head.check_compatible(target.config)
    except ValueError as err:
        raise UserInputError(f"{head_dir}: {err}") from err
    return head


def load_backends(args: argparse.Namespace, target: TargetModel, head: DraftHead):
    """(speculative backend, AR backend) of `--backend`: AR runs on the same kind of backend, so speedups
    compare like with like (docs/DESIGN.md section 4); on torch the AR backend has no head (no taps)."""
    kind = resolve_kind(args.backend)
    if kind in ENGINE_KINDS and args.engine_dir is None:
        raise UserInputError(f"--backend {args.backend} needs --engine-dir DIR (written by jetflow-export)")
    backend = load_backend(
        kind,
        target=target,
        head=head,
        engine_dir=args.engine_dir,
        device=args.device,
        topk=max(8, args.width),
        intra_op_threads=getattr(args, "threads", None),
    )
    try:
        backend.check_width(args.width)
    except ValueError as err:
        raise UserInputError(str(err)) from err
    return backend, load_backend("torch", target=target) if kind == "torch" else backend


def acceptance_prior(args: argparse.Namespace) -> AcceptanceProfile | None:
    """`--acceptance-profile`, else the profile saved beside the head, else the one in the engine
    directory (`jetflow-export` copies the head's); a width it was not measured at is refused when given
    explicitly and ignored (with a note) when found."""
    path, explicit = args.acceptance_profile, True
    for folder in (args.head, getattr(args, "engine_dir", None)):
        if path is None and folder is not None and (Path(folder) / ACCEPTANCE_PROFILE_FILE).is_file():
            path, explicit = Path(folder) / ACCEPTANCE_PROFILE_FILE, False
    if path is None:
        return None
    prior = AcceptanceProfile.load(path)
    if prior.width != args.width:
        if explicit:
            raise UserInputError(
                f"acceptance profile {path} was measured at --width {prior.width}, not {args.width}"
            )
        print(f"note: ignoring {path} (measured at --width {prior.width}, not {args.width})", file=sys.stderr)
        return None
    return prior


def add_cost_profile_arguments(p: argparse.ArgumentParser) -> None:
    """`--cost-profile FILE` and `--measure-costs`, the cost half of `--budget auto` (every command)."""
    p.add_argument(
        "--cost-profile",
        type=Path,
        default=None,
        help="--budget auto: use (or measure into) this cost profile JSON instead of the per-machine cache",
    )
    p.add_argument(
        "--measure-costs",
        action="store_true",
        help="--budget auto: measure this machine's cost profile in full now (minutes), replacing the quick "
        "one-pass profile a first run measures (the decode loop's clock corrects a quick one as it decodes)",
    )


def auto_budget(args: argparse.Namespace, prior: AcceptanceProfile | None) -> AutoBudget:
    """`--budget auto` as the flags of `add_cost_profile_arguments` describe it, with `prior`; a progress
    bar on stderr while a profile is measured."""
    return AutoBudget(
        prior=prior, cost_profile_path=args.cost_profile, full_profile=args.measure_costs, progress=True
    )


def budget_policy(args: argparse.Namespace) -> int | AutoBudget:
    if args.budget != "auto":
        return args.budget
    return auto_budget(args, acceptance_prior(args))
