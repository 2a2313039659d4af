"""Anchor metadata (ARCHITECTURE §5.4): which recurrent-state snapshots exist for a model, where they sit,
and the file they were spilled to, so a restarted daemon knows what it has."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import sqlite_utils


@dataclass(frozen=True)
class AnchorRecord:
    model_fingerprint: str  # weights + dtype + cache layout (a snapshot is valid for those only)
    prefix_hash: str  # hex of kv/snapshots.prefix_key(tokens, position)
    position: int
    kind: str
    bytes: int
    last_use: float
    spill_path: str | None = None  # relative to the state directory


def put(db: sqlite_utils.Database, rec: AnchorRecord) -> None:
    db.table("anchors").upsert(asdict(rec), pk=("model_fingerprint", "prefix_hash"))


def for_model(db: sqlite_utils.Database, fingerprint: str) -> list[AnchorRecord]:
    """Most recently used first."""
    rows = db.query(
        "SELECT * FROM anchors WHERE model_fingerprint = ? ORDER BY last_use DESC", (fingerprint,)
    )
    return [AnchorRecord(**r) for r in rows]


def touch(db: sqlite_utils.Database, fingerprint: str, prefix_hash: str, when: float) -> None:
    db.execute(
        "UPDATE anchors SET last_use = ? WHERE model_fingerprint = ? AND prefix_hash = ?",
        (when, fingerprint, prefix_hash),
    )


def delete(db: sqlite_utils.Database, fingerprint: str, prefix_hash: str) -> None:
    db.execute(
        "DELETE FROM anchors WHERE model_fingerprint = ? AND prefix_hash = ?",
        (fingerprint, prefix_hash),
    )


def total_bytes(db: sqlite_utils.Database, fingerprint: str) -> int:
    row = db.execute(
        "SELECT COALESCE(SUM(bytes), 0) FROM anchors WHERE model_fingerprint = ?", (fingerprint,)
    )
    return int(row.fetchone()[0])
