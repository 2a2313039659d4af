"""Prometheus text exposition of the daemon's serving metrics (no client library needed).

Counters and the TTFT histogram are updated from the event loop; ``record_tokens`` is called
by the engine thread (a lock keeps the throughput window consistent). Engine gauges (running,
waiting, KV pages, expert cache) come from the bridge's last ``EngineStats`` snapshot.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
THROUGHPUT_WINDOW_S = 10.0


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.aborted = 0
        self.rejected_overloaded = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self.started = time.time()

    # --- updates -----------------------------------------------------------------------------

    def record_tokens(self, n: int) -> None:
        """Engine thread: ``n`` tokens produced by one step."""
        if n <= 0:
            return
        now = time.monotonic()
        with self._lock:
            self.generation_tokens += n
            self._window.append((now, n))
            self._trim(now)

    def record_request(self, api: str, status: int) -> None:
        self.requests[(api, status)] += 1

    def record_usage(self, prompt: int, cached: int) -> None:
        self.prompt_tokens += prompt
        self.cached_prompt_tokens += cached

    def record_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        for i, edge in enumerate(TTFT_BUCKETS):
            if seconds <= edge:
                self.ttft_counts[i] += 1
                return
        self.ttft_counts[-1] += 1

    # --- reads -------------------------------------------------------------------------------

    def _trim(self, now: float) -> None:
        while self._window and now - self._window[0][0] > THROUGHPUT_WINDOW_S:
            self._window.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            total = sum(n for _, n in self._window)
        return total / THROUGHPUT_WINDOW_S

    def render(self, stats: Any, in_flight: int, draining: bool) -> str:
        """The /metrics body (Prometheus text format 0.0.4)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {value:g}" for labels, value in samples)

        metric(
            "freetoken_requests_total",
            "counter",
            "HTTP inference requests by API and status.",
            [(f'{{api="{a}",status="{s}"}}', n) for (a, s), n in sorted(self.requests.items())],
        )
        metric(
            "freetoken_prompt_tokens_total",
            "counter",
            "Prompt tokens admitted.",
            [("", self.prompt_tokens)],
        )
        metric(
            "freetoken_prompt_tokens_cached_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            [("", self.cached_prompt_tokens)],
        )
        metric(
            "freetoken_generation_tokens_total",
            "counter",
            "Tokens generated.",
            [("", self.generation_tokens)],
        )
        metric(
            "freetoken_generation_tokens_per_second",
            "gauge",
            f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:g} s.",
            [("", self.tokens_per_second())],
        )
        metric(
            "freetoken_requests_aborted_total",
            "counter",
            "Requests whose client went away before the end.",
            [("", self.aborted)],
        )
        self._ttft_lines(lines)
        metric(
            "freetoken_requests_in_flight",
            "gauge",
            "Admitted requests not yet finished.",
            [("", in_flight)],
        )
        metric(
            "freetoken_draining",
            "gauge",
            "1 while the daemon drains for shutdown.",
            [("", int(draining))],
        )
        if stats is not None:
            self._engine_lines(stats, metric)
        return "\n".join(lines) + "\n"

    def _ttft_lines(self, lines: list[str]) -> None:
        name = "freetoken_time_to_first_token_seconds"
        lines.append(f"# HELP {name} Time from admission to the first generated token.")
        lines.append(f"# TYPE {name} histogram")
        running = 0
        for edge, n in zip(TTFT_BUCKETS, self.ttft_counts, strict=False):
            running += n
            lines.append(f'{name}_bucket{{le="{edge:g}"}} {running}')
        total = running + self.ttft_counts[-1]
        lines.append(f'{name}_bucket{{le="+Inf"}} {total}')
        lines.append(f"{name}_sum {self.ttft_sum:g}")
        lines.append(f"{name}_count {total}")

    @staticmethod
    def _engine_lines(stats: Any, metric: Any) -> None:
        hits = getattr(stats, "expert_hits", 0)
        misses = getattr(stats, "expert_misses", 0)
        rate = hits / (hits + misses) if hits + misses else 0.0
        metric(
            "freetoken_requests_running",
            "gauge",
            "Requests in the running batch.",
            [("", stats.running)],
        )
        metric(
            "freetoken_queue_depth",
            "gauge",
            "Requests waiting for a batch slot.",
            [("", stats.waiting)],
        )
        metric(
            "freetoken_kv_pages_used",
            "gauge",
            "KV cache pages in use.",
            [("", stats.kv_pages_used)],
        )
        metric(
            "freetoken_kv_pages_total",
            "gauge",
            "KV cache pages in the pool.",
            [("", stats.kv_pages_total)],
        )
        metric(
            "freetoken_kv_pages_cached",
            "gauge",
            "KV pages held only by the prefix cache (reusable, evictable).",
            [("", getattr(stats, "kv_pages_cached", 0))],
        )
        metric(
            "freetoken_engine_prompt_tokens_computed_total",
            "counter",
            "Prompt tokens the engine computed (not restored from the prefix cache).",
            [("", getattr(stats, "prompt_tokens_computed_total", 0))],
        )
        used = stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0
        metric("freetoken_kv_usage_ratio", "gauge", "Fraction of KV pages in use.", [("", used)])
        metric(
            "freetoken_expert_cache_hits_total", "counter", "Expert slot-cache hits.", [("", hits)]
        )
        metric(
            "freetoken_expert_cache_misses_total",
            "counter",
            "Expert slot-cache misses.",
            [("", misses)],
        )
        metric(
            "freetoken_expert_cache_hit_ratio", "gauge", "Expert slot-cache hit rate.", [("", rate)]
        )
