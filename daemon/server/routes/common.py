"""Helpers every inference route uses: decoding the body, ids, the per-request log line."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import msgspec
import structlog
from litestar import Request, Response

from ..errors import APIError, InvalidRequest, from_validation_error
from ..generation import Generation
from ..sse import comment_ping, stream_response
from ..state import server_state

log = structlog.get_logger("freetokend.request")

T = TypeVar("T")


async def decode_body(request: Request[Any, Any, Any], kind: type[T]) -> T:
    """The body as ``kind``; any malformed input becomes a 400 naming what is wrong.
    (Bodies over the size limit are refused by Litestar with 413 before this.)"""
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise from_validation_error(e) from None
    except UnicodeDecodeError:
        raise InvalidRequest("The request body is not valid UTF-8.") from None
    except RecursionError:
        raise InvalidRequest("The request body's JSON is nested too deeply.") from None


class ClientGone(APIError):
    """The client closed the connection before the answer was ready (nginx's 499)."""

    status = 499


async def unless_disconnected(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """Await ``work`` (a non-streaming generation) but give up as soon as the client
    disconnects, so its tokens stop being generated. (Streams get this from Litestar.)"""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone("The client disconnected.")
    return task.result()


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def log_request(
    metrics: Any, api: str, gen: Generation, started: float, stream: bool, status: int = 200
) -> None:
    """One structured line per finished request, with its timings; counts it in /metrics."""
    metrics.record_request(api, status)
    total = time.monotonic() - started
    u = gen.usage
    decode_s = total - (gen.ttft or 0.0)
    log.info(
        "request",
        api=api,
        request_id=gen.request_id,
        status=status,
        stream=stream,
        prompt_tokens=u.prompt_tokens,
        cached_tokens=u.cached_tokens,
        completion_tokens=u.completion_tokens,
        finish_reason=gen.finish_reason,
        ttft_ms=round((gen.ttft or 0.0) * 1000, 1),
        total_ms=round(total * 1000, 1),
        decode_tok_s=round(u.completion_tokens / decode_s, 1) if decode_s > 0 else None,
    )


class Output(Protocol):
    """A route's rendering of one generation: SSE frames, or the whole body."""

    def stream(self) -> AsyncIterator[bytes]: ...

    async def complete(self) -> Any: ...


async def respond(
    request: Request[Any, Any, Any],
    api: str,
    gen: Generation,
    out: Output,
    started: float,
    stream: bool,
    ping: Callable[[], bytes] = comment_ping,
) -> Response[Any]:
    """The end every generating route shares: stream ``out`` or send its complete body. However
    the request ends (done, client gone, error), the generation is closed (its KV freed) and
    its log line written, once."""

    metrics = server_state(request).metrics

    def close() -> None:
        gen.close()
        log_request(metrics, api, gen, started, stream=stream)

    if stream:
        return stream_response(out.stream(), close, ping=ping)
    try:
        payload = await unless_disconnected(request, out.complete())
    finally:
        close()
    return Response(payload)
