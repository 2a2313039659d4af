"""This host's measured expert bandwidths (experts/bandwidth.py measures them, the state store
keeps them, the hybrid backend's q* split reads them) and the disk's read rate for the disk tier
(formats/disk_rate.py, on the model's weights file): a plain record, here so that the store need
not import the expert code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BandwidthProfile:
    b_p: float  # bytes/s, pinned host -> accelerator, whole experts the way decode fills them
    b_h: float  # bytes/s of expert weights streamed by the CPU executor at batch 1
    expert_format: str
    accelerator: str
    expert_bytes: int
    # bytes/s of the weights file's reads as the disk tier reads them (1 MiB at random aligned
    # offsets, several in flight); 0 when not measured (``disk_note`` says why)
    b_d: float = 0.0
    disk_direct: bool = (
        False  # O_DIRECT reads (False: through the page cache, which may serve them)
    )
    disk_path: str = ""  # the file read: where the model's experts live
    disk_note: str = ""  # which file that is, or why nothing was measured
