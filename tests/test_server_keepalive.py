"""Keep-alive pings on silent streams.

Regression: a cold Claude Code prompt (~35 K tokens) took over 5 minutes to prefill on a busy
CPU, sent nothing meanwhile, and Claude Code dropped the stream ("no data arrived for more
than 5 minutes"), retried without streaming, and gave up. Now every stream sends its API's
ping while it is silent: Anthropic ``ping`` events, ``response.in_progress`` again on the
Responses API (Codex's idle timer counts events, not bytes), an SSE comment on chat and
completions. The app runs in-process on the built-in model, served by uvicorn, with an engine
step that stalls (a long prefill) and a short ping interval; each API's own SDK reads the
stream.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import uvicorn
from server_support.daemon import quiet_control_plane

from freetokend.server import sse
from freetokend.server.app import create_app

STALL_MIN_S = 0.3  # a stalled engine step (a long prefill) takes at least this long,
PINGS = 3  # and lasts until this many pings went out (30 s at most), so a loaded machine's
PING_S = 0.1  # slow request setup cannot eat the silence the assertions count pings in


# --- the keepalive generator ---------------------------------------------------------------


async def frames(*gaps: float) -> AsyncIterator[bytes]:
    """One frame after each gap (seconds)."""
    for i, gap in enumerate(gaps):
        await asyncio.sleep(gap)
        yield f"frame{i}".encode()


def collect(source: AsyncIterator[bytes], interval: float) -> list[bytes]:
    async def main() -> list[bytes]:
        return [f async for f in sse.keepalive(source, lambda: b"ping", interval)]

    return asyncio.run(main())


def test_pings_fill_silences_and_frames_keep_their_order() -> None:
    """The source stays silent until three pings went out (not for a fixed time, whose pings
    a loaded machine's late wake-ups could thin out); they cannot come faster than the
    interval."""

    async def main() -> tuple[list[bytes], float]:
        three, pinged, silence = asyncio.Event(), [0], [0.0]

        def ping() -> bytes:
            pinged[0] += 1
            if pinged[0] == 3:
                three.set()
            return b"ping"

        async def source() -> AsyncIterator[bytes]:
            yield b"frame0"
            started = time.monotonic()
            await asyncio.wait_for(three.wait(), 30)
            silence[0] = time.monotonic() - started
            yield b"frame1"
            yield b"frame2"

        out = [f async for f in sse.keepalive(source(), ping, 0.1)]
        return out, silence[0]

    out, silence = asyncio.run(main())
    frames_only = [f for f in out if f != b"ping"]
    assert frames_only == [b"frame0", b"frame1", b"frame2"]
    assert out[0] == b"frame0" and out[-2:] == [b"frame1", b"frame2"]
    assert out.count(b"ping") >= 3
    assert silence >= 0.25, f"three pings at 0.1 s intervals came within {silence:.3f} s"


def test_no_ping_when_frames_flow() -> None:
    assert b"ping" not in collect(frames(0.0, 0.01, 0.01), interval=5.0)


def test_errors_pass_through() -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"a"
        await asyncio.sleep(0.25)
        raise RuntimeError("engine failed")

    with pytest.raises(RuntimeError, match="engine failed"):
        collect(failing(), interval=0.1)


def test_closing_cancels_the_wait_for_the_next_frame() -> None:
    cancelled = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b"a"
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        yield b"never"

    async def main() -> float:
        gen = sse.keepalive(slow(), lambda: b"ping", 0.05)
        assert await anext(gen) == b"a"
        assert await anext(gen) == b"ping"  # parked waiting for the next frame
        started = time.monotonic()
        await gen.aclose()  # the client left
        await asyncio.wait_for(cancelled.wait(), 10)
        return time.monotonic() - started

    assert asyncio.run(main()) < 10  # at once, not when the source's 30 s wait ends


# --- each API through its SDK, against the app with a stalled prefill ----------------------


STALL = threading.Event()  # set: the engine's next step stalls (a long prefill)
PINGED = threading.Semaphore(0)  # released once per ping sent
MODEL = "builtin-qwen35moe-tiny"
HELLO: Any = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """The app served by uvicorn in a thread of this process (so the stall and the ping
    interval can be set), with real HTTP for the SDKs. The state is built as ``serve()``
    builds it (the control plane, without its admin socket, VRAM watcher and session spills
    into the shared state folder); the stall is in the engine hub's step, which the bridge
    drives."""
    control = quiet_control_plane()
    state = control.start()
    engine = state.bridge.engine
    real_step = engine.step

    def step() -> Any:
        if STALL.is_set():
            STALL.clear()
            while PINGED.acquire(blocking=False):  # pings of earlier streams
                pass
            started = time.monotonic()
            for _ in range(PINGS):
                assert PINGED.acquire(timeout=30), "the stalled stream sent no pings"
            time.sleep(max(0.0, STALL_MIN_S - (time.monotonic() - started)))
        return real_step()

    real_keepalive = sse.keepalive

    def counted_keepalive(
        frames: AsyncIterator[bytes], ping: Callable[[], bytes], interval: float
    ) -> AsyncIterator[bytes]:
        def counted() -> bytes:
            PINGED.release()
            return ping()

        return real_keepalive(frames, counted, interval)

    engine.step = step
    mp = pytest.MonkeyPatch()
    mp.setattr(sse, "KEEPALIVE_S", PING_S)
    mp.setattr(sse, "keepalive", counted_keepalive)
    server = uvicorn.Server(
        uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        mp.undo()
        control.stop()


def raw_stream(url: str, path: str, body: dict[str, Any]) -> str:
    """The stream's text as sent (the SDKs hide pings)."""
    STALL.set()
    req = urllib.request.Request(
        url + path,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


def test_anthropic_stream_pings_during_prefill(url: str) -> None:
    import anthropic

    sdk = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    STALL.set()
    with sdk.messages.stream(model=MODEL, max_tokens=4, messages=HELLO) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.usage.output_tokens >= 1
    raw = raw_stream(url, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": HELLO})
    events = [line[len("event: ") :] for line in raw.splitlines() if line.startswith("event: ")]
    first_block = events.index("content_block_start")
    # message_start waits for the prefill (its usage counts the cached prompt tokens)
    assert events[first_block - 1] == "message_start" and events.count("message_start") == 1
    assert events[:first_block].count("ping") >= 2  # the prefill's silence, filled
    assert 'data: {"type":"ping"}' in raw


def test_responses_stream_repeats_in_progress(url: str) -> None:
    import openai

    sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    STALL.set()
    events = list(
        sdk.responses.create(model=MODEL, input="Hello", max_output_tokens=4, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.in_progress") >= 3  # the first one, then pings
    assert kinds[-1] == "response.completed"
    seqs = [e.sequence_number for e in events]
    assert seqs == sorted(set(seqs))  # pings take their place in the sequence


def test_chat_stream_pings_are_comments(url: str) -> None:
    import openai

    sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    STALL.set()
    chunks = list(
        sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, stream=True)
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    raw = raw_stream(
        url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": HELLO}
    )
    assert raw.count(": ping\n\n") >= 2
    assert raw.rstrip().endswith("data: [DONE]")
