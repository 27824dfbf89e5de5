"""Target regeneration: `python -m jetflow_pl predict --config configs/regenerate/<name>.yaml`.

`PromptDataModule` (prompts) -> `RegenerationModule` (frozen target generates) -> `RegenerationWriter`
(atomic shards, manifest, resume, merged `<out>/dataset`). The output schema is in `schema.py`.
`EndpointRegenerationModule` + `EndpointRegenerationWriter` (`endpoint.py`) take the responses from an
OpenAI-compatible server instead of an in-process target, into the same rows and folder layout.
"""

from data_gen.regenerate.endpoint import EndpointRegenerationModule, EndpointRegenerationWriter
from data_gen.regenerate.endpoint_client import EndpointError
from data_gen.regenerate.module import RegenerationModule, batched_generate, sample_seed
from data_gen.regenerate.prompts import PromptDataModule, PromptSourceError
from data_gen.regenerate.schema import ARROW_SCHEMA, COLUMNS
from data_gen.regenerate.writer import OutputFolderError, RegenerationProgressBar, RegenerationWriter

__all__ = [
    "ARROW_SCHEMA",
    "COLUMNS",
    "EndpointError",
    "EndpointRegenerationModule",
    "EndpointRegenerationWriter",
    "OutputFolderError",
    "PromptDataModule",
    "PromptSourceError",
    "RegenerationModule",
    "RegenerationProgressBar",
    "RegenerationWriter",
    "batched_generate",
    "sample_seed",
]
