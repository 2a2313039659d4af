"""Time-sized prefill chunks beside decode rows (``StepPacer``, used by the scheduler).

A step that carries decode rows delays every decoding stream by its whole length, so a long
prompt's chunk beside them sets the streams' inter-token latency. With a fixed chunk of
``max_step_tokens`` prompt tokens that is one 512-token chunk per token (seconds at a long
context on a CPU). The pacer sizes that chunk by time instead, from running estimates
(exponential moving averages of measured step times) of

- a decode-only step's seconds, for each number of decode rows, and
- the seconds a chunk of n prompt tokens adds to such a step, for each n it ran recently: the
  cost is not linear in n (a step with a chunk of 2 or more tokens takes the prefill path, with
  its own fixed cost, where a 1-token chunk does not; kernels change tiles with the rows), and
  it follows the prompt as its attention grows. A size not run recently is predicted from the
  nearest run sizes: linearly between two; above them on from the largest at the marginal
  cost of a token between the two largest (a chunk has a fixed part: in proportion alone would
  never try a larger chunk that still fits, and steps would stay well under the budget), at
  least half and at most all of the largest's cost a token; below them in proportion to the
  smallest. A size of 2 or more is never predicted from a 1-token chunk's cost (that chunk runs
  with the decode rows and may add nothing measurable: predicting from it would grant the whole
  token budget at once), so where 1 fits and no larger size is known, the next chunk tries 2.

It gives the prompt chunks the largest n, from 1 up, whose step is predicted to take at most
``budget`` times a decode-only one, clamped to [``min_tokens``, the step's token budget]. Without
decode rows the chunk stays the whole token budget (``max_step_tokens``): a prompt alone
prefills as fast as before.

Where the decode time of this many rows is unknown, or was last measured ``refresh_steps``
steps ago (the streams' context grows meanwhile), the step runs the decode rows alone (a prefill
share of 0) and measures it; that measurement weighs more than one of a run of decode-only
steps (the estimate it updates is old). A chunk size's estimate not updated for
``FORGET_REFRESHES`` refresh periods is dropped, so a size once measured too dear (a hiccup of
the machine, or a shorter context) is tried again now and then. Until a chunk's cost is
known, the share is ``min_tokens``.

On a MoE model under the cpu backend the chunks come out small: a decode step is bound by reading
its experts, and each prompt token routes to experts of its own, so a chunk's cost grows with its
distinct experts, nearly linearly while they are few. Measured (bench_server's ITL figure, its
steps timed by a temporary log in EngineCore._step; 2-core AMD EPYC Zen 4, Q4_K_M, 128 experts,
top-8; one stream beside a 16k-token prompt, budget 3): 7556 paced steps for the prompt, chunks of
2 tokens at the median (1 at p10, 4 at p90), a paced step 26.9 ms at the median (44.7 at p99)
against a decode-only step's 12.0, the paced step growing from 22.5 to 32.7 ms through the prompt
as its attention grows; the slow steps spread over the whole prompt, chunks of the usual sizes
(1-15 tokens, most 2-4), not larger chunks mispredicted.

The clock is the core's (``EngineCore(clock=...)``); tests feed ``observe`` modelled times.
"""

from __future__ import annotations

import bisect

EMA_WEIGHT = 0.25  # weight of the newest measurement in each running estimate
STALE_WEIGHT = 0.5  # ... of a decode time measured again after REFRESH_STEPS (the old is stale)
REFRESH_STEPS = 64  # steps after which a decode-only step measures the decode time again
FORGET_REFRESHES = 4  # a chunk size's estimate unused for this many refresh periods is dropped
MIN_SLOPE = 0.5  # a token past the largest measured chunk: at least this share of its mean cost


class StepPacer:
    def __init__(
        self, budget: float, min_tokens: int = 1, refresh_steps: int = REFRESH_STEPS
    ) -> None:
        if budget != 0 and budget < 1:
            raise ValueError(f"mixed_step_budget must be 0 (off) or at least 1, got {budget}")
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be at least 1, got {min_tokens}")
        self.budget = budget  # a step with decode rows: at most this many decode-only steps
        self.min_tokens = min_tokens
        self.refresh_steps = refresh_steps
        self._decode: dict[int, tuple[float, int]] = {}  # rows -> (seconds, step measured at)
        # chunk tokens -> (seconds they add to a step, step measured at); _sizes: its keys sorted
        self._chunk: dict[int, tuple[float, int]] = {}
        self._sizes: list[int] = []
        self._steps = 0

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def decode_seconds(self, rows: int) -> float | None:
        """The running estimate of a decode-only step of ``rows`` rows (None: not measured)."""
        known = self._decode.get(rows)
        return None if known is None else known[0]

    def chunk_seconds(self, n: int) -> float | None:
        """The predicted seconds a chunk of ``n`` prompt tokens adds to a step (None: no chunk
        measured recently)."""
        self._forget()
        return self._predict(n)

    def _predict(self, n: int) -> float | None:
        if n in self._chunk:
            return self._chunk[n][0]
        # a 1-token chunk runs with the decode rows (no prefill path): its cost, often nothing
        # measurable, says nothing of larger chunks'
        sizes = self._sizes if n == 1 else [s for s in self._sizes if s >= 2]
        if not sizes:
            return None
        i = bisect.bisect_left(sizes, n)
        if i == 0:  # below every measured size: in proportion to the smallest
            return self._chunk[sizes[0]][0] * n / sizes[0]
        lo, e_lo = sizes[i - 1], self._chunk[sizes[i - 1]][0]
        if i == len(sizes):  # above every measured size: see _extrapolate
            return self._extrapolate(sizes, n)
        hi, e_hi = sizes[i], self._chunk[sizes[i]][0]
        return e_lo + (e_hi - e_lo) * (n - lo) / (hi - lo)

    def _extrapolate(self, sizes: list[int], n: int) -> float:
        """A size above every measured one (``sizes``, ascending): on from the largest at the
        marginal cost a token added between the two largest, held between ``MIN_SLOPE`` of
        the largest's cost a token and that whole cost a token (in proportion, where only one
        size is known). A prefill chunk has a fixed part, so in proportion alone overrates
        every larger size (by the fixed part over the size) and never tries one whose step
        would still fit; the floor keeps a noisy pair of estimates from granting many tokens
        at once (a step then overruns by at most what the budget had left, and that size is
        measured)."""
        hi, e_hi = sizes[-1], self._chunk[sizes[-1]][0]
        mean = e_hi / hi
        slope = mean
        if len(sizes) >= 2:
            lo, e_lo = sizes[-2], self._chunk[sizes[-2]][0]
            slope = min(max((e_hi - e_lo) / (hi - lo), MIN_SLOPE * mean), mean)
        return e_hi + slope * (n - hi)

    def prefill_tokens(self, decode_rows: int, limit: int) -> int:
        """How many prompt tokens, at most ``limit``, a step with ``decode_rows`` decode rows
        may take: 0 for a decode-only step that measures the decode time; ``limit`` without
        decode rows or with the pacer off."""
        if not self.enabled or decode_rows == 0 or limit <= 0:
            return max(limit, 0)
        known = self._decode.get(decode_rows)
        if known is None or self._steps - known[1] >= self.refresh_steps:
            return 0
        floor = min(self.min_tokens, limit)
        spare = (self.budget - 1.0) * known[0]
        self._forget()
        n = 0
        while n < limit:
            secs = self._predict(n + 1)
            if secs is None and n == 1:  # 1 fits, nothing known of 2 or more: 2 is tried
                n = 2
            if secs is None or secs > spare:
                break
            n += 1
        return max(floor, n)

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """A step with ``decode_rows`` decode rows and ``prefill_tokens`` prompt tokens took
        ``seconds``."""
        self._steps += 1
        if prefill_tokens == 0:
            if decode_rows > 0:
                old = self._decode.get(decode_rows)
                if old is None:
                    est = seconds
                else:
                    stale = self._steps - old[1] > self.refresh_steps
                    est = _ema(old[0], seconds, STALE_WEIGHT if stale else EMA_WEIGHT)
                self._decode[decode_rows] = (est, self._steps)
            return
        base = 0.0
        if decode_rows > 0:
            known = self._decode.get(decode_rows)
            if known is None:
                return  # the decode rows' share of this step is unknown
            base = known[0]
        extra = max(seconds - base, 0.0)
        old = self._chunk.get(prefill_tokens)
        if old is None:
            bisect.insort(self._sizes, prefill_tokens)
        est = extra if old is None else _ema(old[0], extra, EMA_WEIGHT)
        self._chunk[prefill_tokens] = (est, self._steps)

    def _forget(self) -> None:
        horizon = self._steps - FORGET_REFRESHES * self.refresh_steps
        old = [n for n, (_, at) in self._chunk.items() if at < horizon]
        for n in old:
            del self._chunk[n]
            self._sizes.remove(n)


def _ema(old: float, new: float, weight: float) -> float:
    return old + weight * (new - old)
