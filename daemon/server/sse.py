"""Server-sent events framing, keep-alive pings, and the streaming response that aborts on
disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
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

# A stream is silent while its prompt is prefilled: minutes for an agent's 20-35 K token prompt
# on a CPU. Clients give up on a silent stream (Claude Code and Codex after 5 minutes), so a
# ping goes out whenever nothing did for this long.
KEEPALIVE_S = 15.0
COMMENT_PING = b": ping\n\n"  # ignored by every SSE parser (OpenAI chat/completions clients)


def anthropic_ping() -> bytes:
    """The Messages API's own keep-alive event."""
    return event("ping", {"type": "ping"})


def comment_ping() -> bytes:
    return COMMENT_PING


async def keepalive(
    frames: AsyncIterator[bytes], ping: Callable[[], bytes], interval: float
) -> AsyncGenerator[bytes, None]:
    """``frames`` as they come, plus ``ping()`` after every ``interval`` seconds without one.

    The next frame is awaited in a task that a ping does not disturb; closing this generator
    (the client left) cancels that task, which raises CancelledError inside ``frames``.

    A frame of a decoding stream comes every few milliseconds, so what each costs counts (one
    per token and stream, on the loop's thread beside the engine's): one timer serves the
    whole stream, armed for ``interval`` after the last frame or ping and re-armed only when it
    fires, instead of a timeout per frame (``asyncio.wait``'s: a timer set and cancelled, a
    waiter and callbacks each frame). Measured over a queue-fed source on a busy 2-core EPYC:
    37 us a frame more than the source alone with the timeout per frame, 16 with this one.
    """
    loop = asyncio.get_running_loop()
    source = aiter(frames)
    pending: asyncio.Future[bytes] | None = None
    waiter: asyncio.Future[None] | None = None
    timer: asyncio.TimerHandle | None = None
    last = loop.time()  # when the last frame or ping went out

    def wake(_: object = None) -> None:
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fired() -> None:
        nonlocal timer
        timer = None
        wake()

    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
                pending.add_done_callback(wake)
            if not pending.done():
                if timer is None:
                    timer = loop.call_at(last + interval, fired)
                waiter = loop.create_future()
                await waiter
                if not pending.done():  # the timer: a ping if the stream was silent that long
                    if loop.time() >= last + interval:
                        last = loop.time()
                        yield ping()
                    continue
            try:
                frame = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            last = loop.time()
            yield frame
    finally:
        if timer is not None:
            timer.cancel()
        if pending is not None:
            pending.cancel()


def stream_response(
    body: AsyncIterator[bytes],
    on_close: Callable[[], None],
    headers: dict[str, str] | None = None,
    ping: Callable[[], bytes] = comment_ping,
) -> Stream:
    """Wrap an event generator; ``on_close`` runs exactly once however the stream ends
    (completed, client disconnected, server shutdown), so the request's KV is always freed.
    ``ping()`` is sent whenever the body is silent for ``KEEPALIVE_S`` (see ``keepalive``).

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
        frames = keepalive(body, ping, KEEPALIVE_S)
        try:
            async for chunk in frames:
                yield chunk
        finally:
            close_once()
            await frames.aclose()  # cancels a pending wait for the next frame at once

    return Stream(
        guarded(),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **(headers or {})},
        background=BackgroundTask(close_once),
    )
