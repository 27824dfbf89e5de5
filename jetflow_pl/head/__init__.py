"""The draft head: `DraftHead` (PreTrainedModel) + `DraftHeadConfig` (Qwen3Config + dflash keys)."""

from .cache import HeadCache
from .configuration import DraftHeadConfig, default_target_layer_ids
from .modeling import DraftAttention, DraftDecoderLayer, DraftHead, make_block

__all__ = [
    "DraftAttention",
    "DraftDecoderLayer",
    "DraftHead",
    "DraftHeadConfig",
    "HeadCache",
    "default_target_layer_ids",
    "make_block",
]
