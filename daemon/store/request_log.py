"""A bounded request log: a ring of the last N requests (who asked what, how much was cached)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import sqlite_utils


@dataclass(frozen=True)
class RequestEntry:
    at: float  # unix time the request arrived
    model: str
    endpoint: str  # e.g. /v1/chat/completions
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: str  # stop | length | error | aborted
    ttft_ms: float | None = None
    duration_ms: float | None = None


def append(db: sqlite_utils.Database, entry: RequestEntry, keep: int) -> None:
    """Adds ``entry`` and drops rows older than the last ``keep`` (ids only grow: AUTOINCREMENT)."""
    table = db.table("request_log")
    table.insert(asdict(entry))
    last = table.last_rowid
    if last is not None:
        db.execute("DELETE FROM request_log WHERE id <= ?", (last - keep,))


def recent(db: sqlite_utils.Database, n: int) -> list[RequestEntry]:
    """The last ``n`` entries, newest first."""
    rows = db.query(
        "SELECT at, model, endpoint, prompt_tokens, cached_tokens, completion_tokens, status,"
        " ttft_ms, duration_ms FROM request_log ORDER BY id DESC LIMIT ?",
        (n,),
    )
    return [RequestEntry(**r) for r in rows]
