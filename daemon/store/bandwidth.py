"""Bandwidth profiles (ARCHITECTURE §4.3): B_P and B_H per host, accelerator and expert format,
with the disk's read rate B_D measured on the model's weights file at the same time."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import sqlite_utils


@dataclass(frozen=True)
class BandwidthRow:
    host: str
    gpu: str  # accelerator kind, e.g. "cuda:NVIDIA GeForce RTX 4090" or "standin"
    format: str  # expert format
    b_p: float  # bytes/s, pinned host -> accelerator
    b_h: float  # bytes/s, CPU expert execution
    measured_at: float  # unix time
    expert_bytes: int = 0
    b_d: float = 0.0  # bytes/s, the weights file's reads as the disk tier reads; 0: not measured
    disk_direct: bool = False  # O_DIRECT reads
    disk_path: str = ""
    disk_note: str = ""


def save(db: sqlite_utils.Database, row: BandwidthRow) -> None:
    db.table("bandwidth_profiles").insert(asdict(row))


def latest(db: sqlite_utils.Database, host: str, gpu: str, fmt: str) -> BandwidthRow | None:
    """The most recent profile measured on this host for this accelerator and format."""
    rows = list(
        db.query(
            "SELECT host, gpu, format, b_p, b_h, measured_at, expert_bytes, b_d, disk_direct,"
            " disk_path, disk_note FROM bandwidth_profiles WHERE host = ? AND gpu = ? AND format = ?"
            " ORDER BY measured_at DESC, id DESC LIMIT 1",
            (host, gpu, fmt),
        )
    )
    if not rows:
        return None
    return BandwidthRow(**{**rows[0], "disk_direct": bool(rows[0]["disk_direct"])})
