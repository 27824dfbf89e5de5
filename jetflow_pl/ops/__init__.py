"""Custom operators shared by every backend and by the export graphs."""

from jetflow_pl.ops.tree_attention import (
    packed_mask_to_dense,
    tree_attention,
    tree_attention_reference,
)

__all__ = ["packed_mask_to_dense", "tree_attention", "tree_attention_reference"]
