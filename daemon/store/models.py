"""The model registry: every checkpoint folder the daemon has loaded, with its fingerprint."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import sqlite_utils

from ..formats.gguf_file import split_files

FTW_INDEX = "ftw.json"  # checkpoint/ftw_index.INDEX_NAME (not imported: keeps the store light)


@dataclass(frozen=True)
class ModelRecord:
    path: str
    name: str
    format: str  # hf | ftw | gguf
    fingerprint: str
    last_used: float


def model_format(folder: Path) -> str:
    if folder.is_file():
        return "gguf"
    return "ftw" if (folder / FTW_INDEX).exists() else "hf"


def _gguf_fingerprint(path: Path) -> str:
    """A GGUF file (or split set): the name, size and mtime of every part, and the start of the
    first (magic, version, the first metadata)."""

    h = hashlib.blake2b(digest_size=16)
    parts = split_files(path)
    with parts[0].open("rb") as f:
        h.update(f.read(4096))
    for p in parts:
        st = p.stat()
        h.update(json.dumps([p.name, st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()


def model_fingerprint(folder: Path) -> str:
    """Identity of a checkpoint's weights without reading them: config.json's bytes and the
    name, size and mtime of every weight file. A rewritten checkpoint gets a new fingerprint."""
    if folder.is_file():
        return _gguf_fingerprint(folder)
    h = hashlib.blake2b(digest_size=16)
    config = folder / "config.json"
    h.update(config.read_bytes() if config.exists() else b"")
    for f in sorted(folder.iterdir()):
        if f.suffix in (".safetensors", ".bin") or f.name == FTW_INDEX:
            st = f.stat()
            h.update(json.dumps([f.name, st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()


def register(db: sqlite_utils.Database, rec: ModelRecord) -> None:
    db.table("models").upsert(asdict(rec), pk="path")


def touch(db: sqlite_utils.Database, path: str, when: float) -> None:
    db.execute("UPDATE models SET last_used = ? WHERE path = ?", (when, path))


def get(db: sqlite_utils.Database, path: str) -> ModelRecord | None:
    rows = list(db.query("SELECT * FROM models WHERE path = ?", (path,)))
    return ModelRecord(**rows[0]) if rows else None


def all_models(db: sqlite_utils.Database) -> list[ModelRecord]:
    """Most recently used first."""
    return [ModelRecord(**r) for r in db.query("SELECT * FROM models ORDER BY last_used DESC")]
