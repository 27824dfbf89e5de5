"""Prompt rows from local files: `.jsonl` / `.json` / `.parquet` / `.arrow` / `.csv` or a `datasets` folder.

One reader for every stage that takes prompts from disk (regeneration's `PromptDataModule`, the val/tau
callback, benches), built on `datasets` so every format reads the same way. Each problem is one
`UserInputError` line naming the path; callers that want their own error class re-raise it.
"""

from __future__ import annotations

from pathlib import Path

from jetflow_pl.errors import MissingPathError, UserInputError

#: file suffix -> the `datasets` builder that reads it
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SUFFIXES = (*FILE_BUILDERS, ".arrow")
_DATASET_FOLDER_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def load_local_rows(path: str | Path, split: str = "train") -> list[dict]:
    """All rows of a local prompt file or `datasets.save_to_disk` folder, as plain dicts.

    A `DatasetDict` folder needs `split`. Raises `MissingPathError` for a path that does not exist and
    `UserInputError` for an unreadable, empty or unsupported one.
    """
    import datasets

    path = Path(path).expanduser()
    if not path.exists():
        raise MissingPathError(f"prompt source path does not exist: {path}")
    try:
        if path.is_dir():
            if not any((path / f).exists() for f in _DATASET_FOLDER_MARKERS):
                raise UserInputError(
                    f"{path} is a folder but not a datasets.save_to_disk folder (no dataset_info.json, "
                    "state.json or dataset_dict.json)"
                )
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UserInputError(
                        f"{path} has splits {sorted(ds)}, not the configured split {split!r}"
                    )
                ds = ds[split]
        else:
            suffix = path.suffix.lower()
            if suffix == ".arrow":
                ds = datasets.Dataset.from_file(str(path))
            elif suffix in FILE_BUILDERS:
                if path.stat().st_size == 0:
                    raise UserInputError(f"prompt source {path} is empty: it holds no rows")
                ds = datasets.load_dataset(FILE_BUILDERS[suffix], data_files=str(path), split="train")
            else:
                raise UserInputError(
                    f"unsupported prompt file type {suffix!r} for {path}: use .jsonl, .json, .parquet, "
                    ".arrow, .csv or a datasets.save_to_disk folder"
                )
    except UserInputError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets/arrow raise many types; all mean "unreadable file"
        raise UserInputError(f"cannot read prompt source {path}: {type(err).__name__}: {err}") from err
    return list(ds)
