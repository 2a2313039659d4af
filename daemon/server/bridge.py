"""The engine bridge: one dedicated thread steps the EngineCore; the event loop talks to it.

``EngineCore.step()`` is synchronous and CPU-heavy, so it never runs on the event loop. The
loop side calls ``add_request``/``abort`` directly (the engine validates at once and hands
them over through its own locked inbox), then wakes the engine thread, which runs ``step()``
while anything is unfinished and hands each step's outputs back to the loop in one
``call_soon_threadsafe`` (the loop then feeds each request's handle).

Admission is bounded: the engine batches up to its ``max_batch`` requests and queues the
rest; this bridge admits at most ``max_batch + max_queue`` requests in flight and answers
:class:`Overloaded` beyond that (the client retries after ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from ..runtime import heartbeat
from .errors import InvalidRequest, Overloaded
from .protocols import BridgeEngine

log = structlog.get_logger("freetokend.bridge")

RETRY_AFTER_S = 1
IDLE_WAIT_S = 1.0  # an idle engine thread wakes this often (and refreshes its heartbeat)
# While stepping, the engine thread refreshes its stats snapshot (what /metrics shows) at most
# this often: EngineCore.stats() walks the running requests' pages, Python the loop's thread
# would otherwise wait for (the GIL) every step
STATS_EVERY_S = 0.25


@dataclass
class Submission:
    request_id: str
    prompt_ids: list[int]
    params: Any  # SamplingParams
    constraint: Any | None  # Constraint
    # the params came from the server's edge (ModelService.check_limits, then fit_context),
    # range-checked and fitted to the context: the engine takes them without checking again
    checked: bool = False


@dataclass
class RequestHandle:
    """The loop-side end of one request: an async stream of the engine's StepOutputs."""

    request_id: str
    num_prompt_tokens: int
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished: bool = False
    _queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)

    def _deliver(self, item: Any) -> None:
        self._queue.put_nowait(item)

    async def outputs(self) -> AsyncIterator[Any]:
        """Yields StepOutputs until one is ``finished``; re-raises an engine-side error."""
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            if item.finished:
                self.finished = True
            yield item


class EngineBridge:
    def __init__(self, engine: BridgeEngine, max_batch: int, max_queue: int, metrics: Any) -> None:
        self.engine = engine
        self.capacity = max(1, max_batch) + max(0, max_queue)
        self.metrics = metrics
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._handles: dict[str, RequestHandle] = {}  # every admitted, unfinished request
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats: Any = None  # last EngineStats snapshot, refreshed by the engine thread
        self._stats_at = 0.0  # time.monotonic() of that refresh
        # time.monotonic() of the engine thread's last sign of life (around every step, every
        # IDLE_WAIT_S when idle): the systemd watchdog pings only while it is recent
        self._beat = time.monotonic()

    # --- loop side ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def beat(self) -> float:
        """The engine side's last sign of life: the engine thread's own beat, or a unit of
        progress inside a long operation (a spilled file, a bench iteration, a moved module:
        runtime/heartbeat.py), whichever is later."""
        return max(self._beat, heartbeat.last())

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def check_capacity(self, pending: int = 0) -> None:
        """Overloaded when a new request would not be admitted now, counting ``pending``
        requests still being prepared (rendered, tokenized): routes call it before that
        work, so a full daemon refuses cheaply. (submit checks again.)"""
        if len(self._handles) + pending >= self.capacity:
            raise self._overloaded()

    def _overloaded(self) -> Overloaded:
        return Overloaded(
            f"The server is at capacity ({len(self._handles)} requests in flight); retry shortly.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    def submit(self, sub: Submission) -> RequestHandle:
        """Admit a request or raise Overloaded / InvalidRequest (the engine's own checks,
        e.g. prompt + max_tokens over the context); outputs arrive on the returned handle."""
        with self._lock:
            if len(self._handles) >= self.capacity:
                raise self._overloaded()
            handle = RequestHandle(sub.request_id, len(sub.prompt_ids))
            self._handles[sub.request_id] = handle
        try:
            self.engine.add_request(
                sub.request_id, sub.prompt_ids, sub.params, sub.constraint, checked=sub.checked
            )
        except ValueError as e:
            self.release(sub.request_id)
            raise InvalidRequest(str(e)) from None
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, stop string hit); frees its KV. Idempotent."""
        with self._lock:
            if self._handles.pop(request_id, None) is None:
                return
        self.engine.abort(request_id)
        self._wake.set()

    def release(self, request_id: str) -> None:
        """Forget a request that finished (the engine already freed it)."""
        with self._lock:
            self._handles.pop(request_id, None)

    # --- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._beat = time.monotonic()
            if not self.engine.has_unfinished():
                self._refresh_stats()
                self._idle()
                self._wake.wait(timeout=IDLE_WAIT_S)
                self._wake.clear()
                continue
            self._step()

    def _idle(self) -> None:
        idle = getattr(self.engine, "idle", None)  # EngineCore and EngineHub have it
        if idle is None:
            return
        try:
            idle()
        except Exception:  # idle work (snapshot spill) must not kill the engine thread
            log.exception("engine idle work failed")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # an engine bug must not kill the thread: fail the batch
            log.exception("engine step failed")
            with self._lock:
                rids = list(self._handles)
            for rid in rids:
                self.engine.abort(rid)
                self._send(rid, RuntimeError(f"the engine failed: {e}"))
            return
        # the step's outputs in one hand-off: one wake-up of the loop (a write to its self-pipe
        # and a pass of its selector) a step, not one per token
        handles = self._handles
        batch = [(h, out) for out in outputs if (h := handles.get(out.request_id)) is not None]
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver_all, batch)
        self.metrics.record_tokens(len(outputs))
        if time.monotonic() - self._stats_at >= STATS_EVERY_S:
            self._refresh_stats()

    def _send(self, request_id: str, item: Any) -> None:
        handle = self._handles.get(request_id)  # None once aborted: drop its outputs
        if handle is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(handle._deliver, item)

    def _refresh_stats(self) -> None:
        self._stats_at = time.monotonic()
        try:
            self.stats = self.engine.stats()
        except Exception:
            log.exception("engine stats failed")


def _deliver_all(batch: list[tuple[RequestHandle, Any]]) -> None:
    """On the loop: one step's outputs to their requests' handles."""
    for handle, item in batch:
        handle._deliver(item)
