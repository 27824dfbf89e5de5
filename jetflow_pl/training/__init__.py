"""Distillation core: anchor sampling, training masks, teacher/student losses, metrics, one step.

These are pure functions (plus two torchmetrics metrics) that the Lightning `DistillationModule` calls;
see `docs/ARCHITECTURE.md` and docs/DESIGN.md section 3 for the conventions they implement.
"""

from .anchors import sample_anchors, segment_ids
from .losses import LOSS_KINDS, chunked_kl_loss, offset_weights, teacher_positions
from .masks import block_positions, build_training_mask, document_positions
from .metrics import DepthAgreement, SimulatedAcceptanceLength, simulated_acceptance_length
from .step import BlockBatch, distill_step, prepare_blocks, target_features, target_packing_mask

# The Lightning pieces import lazily, so `import jetflow_pl.training` stays free of Lightning.
_LAZY = {
    "DistillationModule": "module",
    "DistillDataModule": "data",
    "AcceptanceLengthCallback": "callbacks",
    "HFHeadExport": "callbacks",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LOSS_KINDS",
    "AcceptanceLengthCallback",
    "BlockBatch",
    "DepthAgreement",
    "DistillDataModule",
    "DistillationModule",
    "HFHeadExport",
    "SimulatedAcceptanceLength",
    "block_positions",
    "build_training_mask",
    "chunked_kl_loss",
    "distill_step",
    "document_positions",
    "offset_weights",
    "prepare_blocks",
    "sample_anchors",
    "segment_ids",
    "simulated_acceptance_length",
    "target_features",
    "target_packing_mask",
    "teacher_positions",
]
