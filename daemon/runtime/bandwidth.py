"""This host's measured expert bandwidths (experts/bandwidth.py measures them, the state store
keeps them, the hybrid backend's q* split reads them): a plain record, here so that the store
need not import the expert code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BandwidthProfile:
    b_p: float  # bytes/s, pinned host -> accelerator, whole experts the way decode fills them
    b_h: float  # bytes/s of expert weights streamed by the CPU executor at batch 1
    expert_format: str
    accelerator: str
    expert_bytes: int
