"""Conversion of ScaleVec checkpoints: exact folding, export to ScaleVec (remote code) and to stock architectures,
import of stock checkpoints, verification and inspection. The `scalevec-convert` command is `cli.py`."""

from .errors import CheckpointError, ConversionError, TargetError, VerificationError
from .formats import TARGETS
from .inspection import format_summary, inspect_checkpoint
from .pipeline import (
    BeforeCommit,
    ConversionResult,
    OutputOptions,
    Strategy,
    export_checkpoint,
    fold_checkpoint,
    folded_config,
    import_checkpoint,
)
from .verify import Comparison, compare_checkpoints

__all__ = [
    "TARGETS",
    "BeforeCommit",
    "CheckpointError",
    "Comparison",
    "ConversionError",
    "ConversionResult",
    "OutputOptions",
    "Strategy",
    "TargetError",
    "VerificationError",
    "compare_checkpoints",
    "export_checkpoint",
    "fold_checkpoint",
    "folded_config",
    "format_summary",
    "import_checkpoint",
    "inspect_checkpoint",
]
