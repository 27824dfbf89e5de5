"""`python -m jetflow_pl`: the LightningCLI front door (fit / validate / test / predict) plus `generate`.

Every stage that runs under Lightning is picked by its config (`model.class_path`, `data.class_path`), so
regeneration (predict), distillation (fit) and the toy-target trainer share one command and one parser:
unknown keys and wrong types are rejected by jsonargparse with the key named.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from jsonargparse import ActionConfigFile
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from jetflow_pl.errors import NumericalError, UserInputError

_ITEM = re.compile(r"^(\s*)- (.*)$")
_CLASS_PROBLEM = re.compile(r"^Problem with given class_path '([^']+)':\s*$")


def concise_parser_error(message: str) -> str:
    """jsonargparse's message for a bad `model:`/`data:`/callback block, cut to the part naming the key.

    For a subclass-mode key it reports "does not validate against any of the Union subtypes", the
    subtypes, the NoneType alternative and the whole given dict; the useful part is the one error item
    that is not about NoneType. Keep that (`model (pkg.Class): Option 'x' is not accepted`, or
    `model: Import path m.X does not correspond to a subclass of LightningModule`) and drop the rest;
    any other message is returned unchanged.
    """
    lines = message.splitlines()
    head = re.match(r'Parser key "([^"]+)":', lines[0]) if lines else None
    if head is None or "Does not validate against any of the Union subtypes" not in message:
        return message
    for i, line in enumerate(lines):
        item = _ITEM.match(line)
        if not item or "Expected a <class 'NoneType'>" in line:
            continue
        indent = len(item.group(1))
        body = []
        for nxt in lines[i + 1 :]:
            if not nxt.strip() or len(nxt) - len(nxt.lstrip()) <= indent:
                break
            body.append(nxt.strip())
        problem = _CLASS_PROBLEM.match(item.group(2))
        if problem:
            return f"{head.group(1)} ({problem.group(1)}): {' '.join(body)}"
        return f"{head.group(1)}: {' '.join([item.group(2), *body])}"
    return message


class JetflowArgumentParser(LightningArgumentParser):
    """Parser errors as `error: <key and problem>` plus a tip, without the 60-line usage dump."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        # jsonargparse parses nested classes with exit_on_error off and relies on the exception
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "").replace("__main__.py", "python -m jetflow_pl")
        sys.stderr.write(f"error: {concise_parser_error(message)}\n")
        sys.stderr.write(f"tip: `{prog} --help` lists the accepted options\n")
        self.exit(2)


class JetflowCLI(LightningCLI):
    """LightningCLI with subclass mode for model and data, so configs choose the stage's classes.

    `python -m jetflow_pl generate --help` documents the speculative-decoding subcommand, which is
    dispatched before this parser runs.
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """LightningCLI's parser, as `JetflowArgumentParser` so a bad config is one short message."""
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={_lightning_version()}"])
        parser = JetflowArgumentParser(**kwargs)
        parser.add_argument(
            "-c",
            "--config",
            action=ActionConfigFile,
            help="Path to a configuration file in json or yaml format.",
        )
        return parser


def _lightning_version() -> str:
    import lightning.pytorch as pl

    return pl.__version__


def lightning_main(args: Sequence[str] | None = None) -> JetflowCLI:
    return JetflowCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=list(args) if args is not None else None,
        auto_configure_optimizers=False,
    )


def find_user_error(err: BaseException) -> UserInputError | None:
    """The `UserInputError` behind `err`, if any.

    jsonargparse re-raises an error from a class's `__init__` (subclass mode) as a plain ValueError
    ("Does not validate against any of the Union subtypes") chained to the original, so look along the
    `__cause__` / `__context__` chain too.
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, UserInputError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


#: every subcommand of `python -m jetflow_pl`, with what it is for (what `--help` lists)
COMMANDS = {
    "fit": "distill a draft head (LightningCLI: --config FILE; the head lands in HF format)",
    "validate": "validate a head on held-out data (LightningCLI)",
    "test": "test a head (LightningCLI)",
    "predict": "regenerate training data with the target (LightningCLI: --config configs/regenerate/...)",
    "generate": "speculative decoding of prompts, against the target's own AR and HF generate() (--compare)",
    "evaluate": "per-category tau / acceptance / speed table on prompt sets (MT-Bench, ShareGPT, files)",
    "draft-vocab": "give a head a draft vocabulary from regenerated data",
}

USAGE = (
    "usage: python -m jetflow_pl {"
    + ",".join(COMMANDS)
    + "} ...\n\ncommands:\n"
    + "".join(f"  {name:<12} {what}\n" for name, what in COMMANDS.items())
    + "\n`python -m jetflow_pl COMMAND --help` shows a command's flags. Console scripts: jetflow-export (ONNX /\n"
    "TensorRT engines, --format vllm|sglang|jetspec|llamacpp), jetflow-serve (OpenAI-compatible server),\n"
    "jetflow-generate (= generate).\n"
)


def main(argv: Sequence[str] | None = None) -> None:
    """Dispatch `generate`, `evaluate` and `draft-vocab` to their own parsers; everything else is LightningCLI's."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        sys.exit(0 if args else 2)
    try:
        if args and args[0] == "generate":
            from jetflow_pl.generate_cli import main as generate_main

            sys.exit(generate_main(args[1:]))
        if args and args[0] == "evaluate":
            from jetflow_pl.evaluate_cli import main as evaluate_main

            sys.exit(evaluate_main(args[1:]))
        if args and args[0] == "draft-vocab":
            from jetflow_pl.draft_vocab_cli import main as draft_vocab_main

            sys.exit(draft_vocab_main(args[1:]))
        lightning_main(argv)
    except NumericalError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except Exception as err:
        user_error = find_user_error(err)
        if user_error is None:
            raise
        print(f"error: {user_error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
