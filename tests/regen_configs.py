"""The LightningCLI predict config and the predict Trainer the regeneration tests run (in process, through an
endpoint, crashed and resumed): one builder each, so every test drives the same settings and layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

IN_PROCESS = (
    "data_gen.regenerate.module.RegenerationModule",
    "data_gen.regenerate.writer.RegenerationWriter",
)
ENDPOINT = (
    "data_gen.regenerate.endpoint.EndpointRegenerationModule",
    "data_gen.regenerate.endpoint.EndpointRegenerationWriter",
)


def predict_run_config(
    tmp: Path,
    out: Path,
    model_args: dict[str, Any],
    source: str,
    classes: tuple[str, str] = IN_PROCESS,
    batch_size: int = 2,
    shard_size: int = 2,
) -> dict:
    """A `python -m jetflow_pl predict` config: `classes` = (model class, writer class), the model's
    `model_args`, prompts from `source`, shards of `shard_size` rows into `out`, no logger or bar."""
    model_class, writer_class = classes
    return {
        "return_predictions": False,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "logger": False,
            "enable_progress_bar": False,
            "default_root_dir": str(tmp / "logs"),
            "callbacks": [
                {"class_path": writer_class, "init_args": {"output_dir": str(out), "shard_size": shard_size}}
            ],
        },
        "model": {"class_path": model_class, "init_args": dict(model_args)},
        "data": {
            "class_path": "data_gen.regenerate.prompts.PromptDataModule",
            "init_args": {"source": source, "batch_size": batch_size},
        },
    }


def predict_trainer(tmp: Path, writer: Any):
    """A quiet CPU predict trainer with `writer` as its only callback (no logger, checkpoints or bar)."""
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp / "logs"),
        callbacks=[writer],
    )
