"""`python -m jetflow_pl`: the LightningCLI front door (fit / validate / test / predict) plus `generate`.

Every stage that runs under Lightning is picked by its config (`model.class_path`, `data.class_path`), so
regeneration (predict), distillation (fit) and the toy-target trainer share one command and one parser:
unknown keys and wrong types are rejected by jsonargparse with the key named.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

from jetflow_pl.errors import UserInputError


class JetflowCLI(LightningCLI):
    """LightningCLI with subclass mode for model and data, so configs choose the stage's classes.

    `python -m jetflow_pl generate --help` documents the speculative-decoding subcommand, which is
    dispatched before this parser runs.
    """


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


def main(argv: Sequence[str] | None = None) -> None:
    """Dispatch `generate` to its own parser; everything else is LightningCLI's."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] == "generate":
            from jetflow_pl.generate_cli import main as generate_main

            sys.exit(generate_main(args[1:]))
        lightning_main(argv)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
