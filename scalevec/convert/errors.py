"""Errors of the converter: every one names what the user has to look at (a file, a tensor, a config field)."""


class ConversionError(Exception):
    """A checkpoint cannot be converted as asked; nothing was written."""


class CheckpointError(ConversionError):
    """A source checkpoint is unreadable or does not match its config (missing, truncated or corrupted files,
    missing or unexpected tensors, shape mismatches)."""


class TargetError(ConversionError):
    """The requested output format cannot express the model, or the output folder is in the way."""


class VerificationError(ConversionError):
    """The converted checkpoint does not compute what the source computes."""
