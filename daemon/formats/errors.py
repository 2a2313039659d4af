"""The error every checkpoint reader raises (the message names the file and the tensor)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint we cannot load; the message names the tensor and the file."""
