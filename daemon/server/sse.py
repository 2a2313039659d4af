"""Server-sent events framing, and the streaming response that aborts on disconnect."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

_encoder = msgspec.json.Encoder()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def data(payload: Any) -> bytes:
    """An unnamed event (OpenAI chat/completions style): ``data: {...}``."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def event(name: str, payload: Any) -> bytes:
    """A named event (Anthropic and Responses style): ``event: NAME`` + ``data: {...}``."""
    return b"event: " + name.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def stream_response(
    body: AsyncIterator[bytes], on_close: Callable[[], None], headers: dict[str, str] | None = None
) -> Stream:
    """Wrap an event generator; ``on_close`` runs exactly once however the stream ends
    (completed, client disconnected, server shutdown), so the request's KV is always freed.

    Two hooks, because a disconnect cancels the sender while the generator may be parked at
    a ``yield`` (then only the generator's finalizer would run its ``finally``): the
    response's background task runs right after the body ends, disconnect included.
    """
    closed = False

    def close_once() -> None:
        nonlocal closed
        if not closed:
            closed = True
            on_close()

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            close_once()

    return Stream(
        guarded(),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **(headers or {})},
        background=BackgroundTask(close_once),
    )
