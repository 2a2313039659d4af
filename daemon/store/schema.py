"""The store's schema, as ordered migrations. Never edit a shipped step: append a new one.

v1  bandwidth profiles (ARCHITECTURE §4.3) and the model registry
v2  prefix-reuse anchors (ARCHITECTURE §5.4: snapshot metadata and spill files) and the request log
v3  the disk's read rate in the bandwidth profiles (``ftctl bench bw``: B_D for the disk tier);
    rows stored before it read as not measured (b_d 0)
"""

from __future__ import annotations

import sqlite_utils

from .db import Migration


def _v1(db: sqlite_utils.Database) -> None:
    db.execute(
        "CREATE TABLE bandwidth_profiles ("
        " id INTEGER PRIMARY KEY,"
        " host TEXT NOT NULL,"
        " gpu TEXT NOT NULL,"  # the accelerator kind the copy bandwidth was measured on
        " format TEXT NOT NULL,"  # expert format (bf16, fp8, mxfp4, ...)
        " b_p REAL NOT NULL,"  # bytes/s, pinned host -> accelerator expert copies
        " b_h REAL NOT NULL,"  # bytes/s, CPU expert execution
        " expert_bytes INTEGER NOT NULL DEFAULT 0,"
        " measured_at REAL NOT NULL)"
    )
    db.execute(
        "CREATE INDEX bandwidth_latest ON bandwidth_profiles (host, gpu, format, measured_at)"
    )
    db.execute(
        "CREATE TABLE models ("
        " path TEXT PRIMARY KEY,"
        " name TEXT NOT NULL,"
        " format TEXT NOT NULL,"  # hf | ftw
        " fingerprint TEXT NOT NULL,"
        " last_used REAL NOT NULL)"
    )
    db.execute("CREATE INDEX models_by_name ON models (name)")


def _v2(db: sqlite_utils.Database) -> None:
    db.execute(
        "CREATE TABLE anchors ("
        " model_fingerprint TEXT NOT NULL,"  # weights + dtype + cache layout the state belongs to
        " prefix_hash TEXT NOT NULL,"  # hex of the token-prefix hash (kv/snapshots.prefix_key)
        " position INTEGER NOT NULL,"
        " kind TEXT NOT NULL,"
        " bytes INTEGER NOT NULL,"
        " last_use REAL NOT NULL,"
        " spill_path TEXT,"  # file holding the snapshot (and its prefix KV), relative to the state dir
        " PRIMARY KEY (model_fingerprint, prefix_hash))"
    )
    db.execute("CREATE INDEX anchors_lru ON anchors (model_fingerprint, last_use)")
    db.execute(
        "CREATE TABLE request_log ("
        " id INTEGER PRIMARY KEY AUTOINCREMENT,"
        " at REAL NOT NULL,"
        " model TEXT NOT NULL,"
        " endpoint TEXT NOT NULL,"
        " prompt_tokens INTEGER NOT NULL,"
        " cached_tokens INTEGER NOT NULL,"
        " completion_tokens INTEGER NOT NULL,"
        " ttft_ms REAL,"
        " duration_ms REAL,"
        " status TEXT NOT NULL)"
    )


def _v3(db: sqlite_utils.Database) -> None:
    for column in (
        "b_d REAL NOT NULL DEFAULT 0",  # bytes/s, the weights file's reads as the disk tier reads
        "disk_direct INTEGER NOT NULL DEFAULT 0",  # 1: O_DIRECT reads; 0: through the page cache
        "disk_path TEXT NOT NULL DEFAULT ''",  # the file read
        "disk_note TEXT NOT NULL DEFAULT ''",  # which file that is, or why nothing was measured
    ):
        db.execute(f"ALTER TABLE bandwidth_profiles ADD COLUMN {column}")


MIGRATIONS: list[Migration] = [
    (1, "bandwidth profiles and model registry", _v1),
    (2, "prefix-reuse anchors and request log", _v2),
    (3, "disk read rate in bandwidth profiles", _v3),
]
