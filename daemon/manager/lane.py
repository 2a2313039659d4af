"""A lane: one resident model's EngineCore as the engine hub drives it, with its serving counters.

The counters are what ``ftctl stats`` shows per model: tokens per second over a sliding window,
time to first token (from ``add_request`` to the first sampled token), requests finished.
They are updated by the engine thread (outputs) and the submitting thread (add times), under a
small lock of their own.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.core import StepOutput
    from ..engine.protocols import ServingEngine

WINDOW_S = 10.0  # tokens/s window
TTFT_SAMPLES = 256  # most recent first-token latencies kept for mean/p50/p90


@dataclass
class LaneCounters:
    requests_finished: int = 0
    tokens_generated: int = 0
    _window: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)
    _ttft: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=TTFT_SAMPLES)
    )
    _submitted: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def submitted(self, rid: str) -> None:
        with self._lock:
            self._submitted[rid] = time.monotonic()

    def forget(self, rid: str) -> None:
        with self._lock:
            self._submitted.pop(rid, None)

    def outputs(self, outs: list[StepOutput]) -> None:
        """Engine thread: the StepOutputs of one step of this lane."""
        if not outs:
            return
        now = time.monotonic()
        with self._lock:
            self.tokens_generated += len(outs)
            self._window.append((now, len(outs)))
            for out in outs:
                t0 = self._submitted.pop(out.request_id, None)
                if t0 is not None:
                    self._ttft.append(now - t0)
                if out.finished:
                    self.requests_finished += 1
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._window and now - self._window[0][0] > WINDOW_S:
            self._window.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._window) / WINDOW_S

    def ttft(self) -> tuple[float, float, float]:
        """(mean, p50, p90) seconds over the recent samples; zeros before the first."""
        with self._lock:
            xs = sorted(self._ttft)
        if not xs:
            return 0.0, 0.0, 0.0
        return statistics.fmean(xs), xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.9))]


@dataclass(eq=False)
class Lane:
    """One resident model's engine (an EngineCore) plus its counters."""

    name: str
    core: ServingEngine  # an EngineCore
    counters: LaneCounters = field(default_factory=LaneCounters)
