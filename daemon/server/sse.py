"""Server-sent events framing, and the streaming response that aborts on disconnect."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
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
    """Wrap an event generator; ``on_close`` runs however the stream ends (completed, client
    disconnected, server shutdown), so the request's KV is always freed."""

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            on_close()

    return Stream(
        guarded(),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **(headers or {})},
    )
