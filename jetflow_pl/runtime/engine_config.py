"""`config.json` of an engine directory: written by the exporter, validated by every runtime backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jetflow_pl.runtime.contract import CONFIG_FILE, VARIANTS, graph_io

FORMAT = "jetflow-engine"
FORMAT_VERSION = 1

_REQUIRED = (
    "format",
    "format_version",
    "variant",
    "graphs",
    "block_size",
    "mask_token_id",
    "topk",
    "vocab_size",
    "max_positions",
    "target_layer_ids",
    "causal_head",
    "target",
    "head",
)


def write_engine_config(engine_dir: Path, config: dict[str, Any]) -> Path:
    path = Path(engine_dir) / CONFIG_FILE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def load_engine_config(engine_dir: str | Path) -> dict[str, Any]:
    """Read and check an engine directory's config; raise one ValueError/FileNotFoundError naming the problem."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise FileNotFoundError(f"engine directory does not exist: {engine_dir}")
    path = engine_dir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{engine_dir} is not an engine directory: it has no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(f"{path} is not a jetflow engine config (format != {FORMAT!r})")
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {config.get('format_version')!r}; this release reads {FORMAT_VERSION}"
        )
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise ValueError(f"{path} lacks required keys: {', '.join(missing)}")
    if config["variant"] not in VARIANTS:
        raise ValueError(f"{path}: unknown variant {config['variant']!r} (expected one of {VARIANTS})")
    batched, max_batch = config.get("batched", False), config.get("max_batch", 1)
    if not isinstance(batched, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(
            f"{path}: 'batched' must be true/false and 'max_batch' an integer >= 1, got "
            f"{batched!r} and {max_batch!r}"
        )
    if max_batch > 1 and not batched:
        raise ValueError(f"{path}: max_batch {max_batch} needs batched graphs ('batched': true)")
    for role in ("head", "target"):
        graph = config["graphs"].get(role, {})
        want = list(graph_io(role, batched)[0])
        if "inputs" in graph and list(graph["inputs"]) != want:
            layout = "batched" if batched else "batch-1"
            raise ValueError(
                f"{path}: the {role} graph's inputs {graph['inputs']} are not the {layout} contract's {want}"
            )
        file = graph.get("file")
        if not file or not (engine_dir / file).is_file():
            raise FileNotFoundError(
                f"{engine_dir}: the {role} graph {file!r} named in {CONFIG_FILE} is missing"
            )
    return config
