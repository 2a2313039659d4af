"""Time-sized prefill chunks beside decode rows (engine/pacing.py ``StepPacer``, the scheduler's
use of it and the core's step clock).

The pacer alone is fed modelled step times. The engine runs with an injected clock that each
forward advances by a modelled cost of its plan (``Modelled``), so the chunk sizes are the same
on every machine: a step with decode rows stays within its budget, a prompt alone keeps full
chunks, and the outputs (a decoding stream's and the long prompt's) are those of the
fixed-chunk engine. Those two engines cut the prompt in different places, so the host kernels
sum some rows in another order (test_cpu_batch_invariance.py's docstring): tokens compare up to
a near-tie, logprobs within LOGPROB_ATOL, as there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_check import assert_greedy_agrees
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.core import NO_TOKEN
from freetokend.engine.pacing import FORGET_REFRESHES, REFRESH_STEPS, StepPacer
from freetokend.engine.sampler import SamplingParams
from freetokend.engine.scheduler import StepPlan

LOGPROB_ATOL = 1e-2  # bf16 checkpoints, chunks cut elsewhere: ~3e-3 (test_cpu_batch_invariance)
NEAR_TIE = 1e-2
CHUNK = 64  # max_step_tokens of these engines
BUDGET = 2.0


# ---- the pacer alone ------------------------------------------------------------------------


def _step_s(rows: int, tokens: int, pos: int = 0) -> float:
    """A modelled step: a fixed part, each decode row, each prompt token (dearer further into
    the prompt, as its attention grows)."""
    return 0.008 + 0.002 * rows + tokens * (0.003 + 1e-5 * pos)


def test_without_decode_rows_or_when_off_the_chunk_is_the_whole_budget() -> None:
    pacer = StepPacer(BUDGET)
    assert pacer.prefill_tokens(0, 512) == 512
    off = StepPacer(0)
    off.observe(1, 0, 0.01)
    assert not off.enabled and off.prefill_tokens(1, 511) == 511
    for bad in (0.5, -1.0):
        with pytest.raises(ValueError, match="at least 1"):
            StepPacer(bad)


def test_decode_time_is_measured_first_then_chunks_fit_the_budget() -> None:
    pacer = StepPacer(BUDGET)
    # nothing known of one decode row: a decode-only step measures it
    assert pacer.prefill_tokens(1, 511) == 0
    pacer.observe(1, 0, _step_s(1, 0))
    assert pacer.decode_seconds(1) == pytest.approx(_step_s(1, 0))
    # no prompt token's cost yet: the smallest chunk
    assert pacer.prefill_tokens(1, 511) == 1
    assert pacer.prefill_tokens(2, 510) == 0  # two rows: not measured yet
    pos, sizes = 0, list[int]()
    for _ in range(200):
        n = pacer.prefill_tokens(1, 511)
        if n == 0:  # a refresh of the decode time
            pacer.observe(1, 0, _step_s(1, 0))
            continue
        secs = _step_s(1, n, pos)
        assert secs <= BUDGET * _step_s(1, 0) * 1.02, (pos, n, secs)
        # what fits the 10 ms a decode step leaves, at this token's cost (the estimate lags)
        ideal = max(1, int((BUDGET - 1) * _step_s(1, 0) / (0.003 + 1e-5 * pos)))
        assert abs(n - ideal) <= 1 or not sizes, (pos, n, ideal)
        pacer.observe(1, n, secs)
        sizes.append(n)
        pos += n
    # 1, then 2 tried (never extrapolated from 1), then three tokens of 3 ms; one once they
    # cost over 5 ms
    assert sizes[:4] == [1, 2, 3, 3] and sizes[-1] == 1, sizes
    assert pacer.chunk_seconds(1) == pytest.approx(0.003 + 1e-5 * pos, rel=0.05)


def test_decode_time_is_measured_again_after_refresh_steps() -> None:
    """The streams' decode step doubles (their context grew): the refreshes follow it, and the
    chunks grow into the room it leaves."""
    pacer = StepPacer(BUDGET)
    pacer.observe(1, 0, 0.010)
    pacer.observe(1, 1, 0.013)
    zeros, sizes = list[int](), list[int]()
    for i in range(8 * (REFRESH_STEPS + 1)):
        n = pacer.prefill_tokens(1, 512)
        if n == 0:
            zeros.append(i)
            pacer.observe(1, 0, 0.020)
        else:
            assert n <= 6  # 0.003 s a token, within the 0.020 s a decode step leaves at most
            pacer.observe(1, n, 0.020 + 0.003 * n)
            sizes.append(n)
    # REFRESH_STEPS steps after each measurement (the first came before the loop)
    assert zeros[:3] == [REFRESH_STEPS - 1 + k * (REFRESH_STEPS + 1) for k in range(3)], zeros
    # half way to the new decode time per refresh
    assert pacer.decode_seconds(1) == pytest.approx(0.020 - 0.010 * 0.5 ** len(zeros))
    assert sizes[-1] == 6, sizes


def test_a_chunk_is_never_below_one_token_nor_above_the_limit() -> None:
    pacer = StepPacer(BUDGET)
    pacer.observe(1, 0, 0.010)
    pacer.observe(1, 1, 0.500)  # one token costs far more than the budget leaves
    assert pacer.prefill_tokens(1, 512) == 1
    fast = StepPacer(BUDGET)
    fast.observe(1, 0, 0.010)
    fast.observe(1, 4, 0.010)  # prompt tokens add nothing measurable
    assert fast.prefill_tokens(1, 37) == 37


def test_a_one_token_chunk_that_costs_nothing_does_not_grant_the_whole_budget() -> None:
    """A 1-token chunk runs with the decode rows, and beside a memory-bound decode step it may
    add nothing measurable: larger sizes are not predicted from it (that would grant the whole
    limit, seconds of prefill in one step), 2 is tried next, then sizes follow what 2 cost."""
    pacer = StepPacer(BUDGET)
    pacer.observe(1, 0, 0.010)
    pacer.observe(1, 1, 0.010)
    assert pacer.chunk_seconds(1) == 0.0
    assert pacer.chunk_seconds(2) is None
    assert pacer.prefill_tokens(1, 511) == 2
    pacer.observe(1, 2, 0.010 + 0.004)  # the prefill path: 2 ms a token
    assert pacer.prefill_tokens(1, 511) == 5  # 10 ms spare at 2 ms a token


def test_chunks_with_a_fixed_part_fill_the_budget() -> None:
    """A prefill chunk costs a fixed part plus each token: sizes above the largest measured
    are predicted on at the marginal cost of a token, so the steps grow to the largest chunk
    that fits the budget (in proportion to the largest, every larger size looks dearer than it
    is by the fixed part over the size, and the chunks stop short of it)."""
    budget, decode = 3.0, 0.010
    pacer = StepPacer(budget)
    pacer.observe(1, 0, decode)

    def extra_s(n: int) -> float:
        return 0.001 if n == 1 else 0.0055 + 0.002 * n

    sizes = []
    for _ in range(REFRESH_STEPS - 2):
        n = pacer.prefill_tokens(1, 512)
        secs = decode + extra_s(n)
        assert secs <= budget * decode * 1.0001, (n, sizes)
        pacer.observe(1, n, secs)
        sizes.append(n)
    # 0.020 s of room: 7 tokens (0.0055 + 7 x 0.002), reached within a few steps and kept
    assert sizes[:3] == [1, 2, 4] and sizes[-20:] == [7] * 20, sizes


def test_a_dear_step_kind_is_not_tried_again_at_once() -> None:
    """A chunk of 2 or more tokens takes the prefill path with a fixed cost of its own: the
    pacer learns that size 2 is over the budget where 1 is not, and stays at 1 (no steps over
    the budget every other step) until that estimate is forgotten."""
    pacer = StepPacer(BUDGET)
    pacer.observe(1, 0, 0.010)

    def step_s(n: int) -> float:
        return 0.010 + (0.004 if n == 1 else 0.030 + 0.002 * n)

    over = []
    for _ in range(FORGET_REFRESHES * REFRESH_STEPS + 4 * REFRESH_STEPS):
        n = pacer.prefill_tokens(1, 512)
        secs = step_s(n) if n else 0.010
        pacer.observe(1, n, secs)
        if secs > BUDGET * 0.010:
            over.append(n)
    # the first try of 2, then one again each time its estimate is forgotten
    assert over == [2, 2], over


# ---- the engine, on a modelled clock --------------------------------------------------------


class Modelled:
    """The engine's clock, advanced by each forward by the modelled cost (``_step_s``) of the
    step plan it runs; records each plan's (decode rows, prompt chunk lengths, seconds)."""

    def __init__(self, llm: LLM) -> None:
        self.now = 0.0
        self.steps: list[tuple[int, list[int], float]] = []
        eng = llm.engine
        schedule, forward = eng.scheduler.schedule, llm.runner.forward
        plans: list[StepPlan] = []

        def recorded_schedule() -> StepPlan:
            plans.append(schedule())
            return plans[-1]

        def timed_forward(work):  # type: ignore[no-untyped-def]
            plan = plans.pop()
            rows = sum(1 for s in plan if s.decode)
            chunks = [len(s.tokens) for s in plan if not s.decode]
            pos = max((s.state.num_tokens for s in plan if not s.decode), default=0)
            secs = _step_s(rows, sum(chunks), pos)
            self.now += secs
            self.steps.append((rows, chunks, secs))
            return forward(work)

        eng.scheduler.schedule = recorded_schedule  # type: ignore[method-assign]
        llm.runner.forward = timed_forward  # type: ignore[method-assign]
        eng.clock = lambda: self.now

    @classmethod
    def of(
        cls, llm: LLM, jobs: list[tuple[list[int], int, int]]
    ) -> list[tuple[int, list[int], float]]:
        """The steps of serving ``jobs`` on a fresh ``llm``."""
        clock = cls(llm)
        _serve(llm, jobs)
        return clock.steps


Step = tuple[int, float | None, list[tuple[int, float]] | None]


def _serve(llm: LLM, jobs: list[tuple[list[int], int, int]]) -> list[list[Step]]:
    """Greedy continuations with logprobs of each (prompt, max_tokens, engine step it joins
    before)."""
    out: list[list[Step]] = [[] for _ in jobs]
    step, waiting = 0, sorted(range(len(jobs)), key=lambda i: jobs[i][2])
    while waiting or llm.engine.has_unfinished():
        while waiting and jobs[waiting[0]][2] <= step:
            i = waiting.pop(0)
            params = SamplingParams(max_tokens=jobs[i][1], ignore_eos=True, logprobs=3)
            llm.engine.add_request(f"r{i}", jobs[i][0], params)
        for o in llm.engine.step():
            if o.token_id != NO_TOKEN:
                out[int(o.request_id[1:])].append((o.token_id, o.logprob, o.top_logprobs))
        step += 1
    return out


def _assert_same(
    got: list[list[Step]], want: list[list[Step]], prompts: list[list[int]], scorer: LLM
) -> None:
    assert_greedy_agrees(
        [[t for t, _, _ in g] for g in got], [[t for t, _, _ in w] for w in want],
        prompts, scorer, margin=NEAR_TIE,
    )  # fmt: skip
    for g, w in zip(got, want, strict=True):
        for (t, lp, top), (wt, wlp, wtop) in zip(g, w, strict=False):
            if t != wt:
                break  # parted at a near-tie
            assert lp == pytest.approx(wlp, abs=LOGPROB_ATOL)
            assert top is not None and wtop is not None
            assert [v for _, v in top] == pytest.approx([v for _, v in wtop], abs=LOGPROB_ATOL)


def _llm(d: Path, budget: float, **kw: Any) -> LLM:
    kw = {"prefix_cache": False, **kw}
    return LLM(d, "cpu", max_model_len=512, kv_tokens=2048, max_step_tokens=CHUNK,
               mixed_step_budget=budget, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An attention-only MoE (the hybrid one is in the snapshot test)."""
    d = tmp_path_factory.mktemp("qwen3_moe-bf16")
    make_tiny("qwen3_moe", d, seed=23, dtype=torch.bfloat16)
    return d


def _prompts() -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(4)
    return (
        torch.randint(2, 97, (12,), generator=g).tolist(),  # the decoding stream's
        torch.randint(2, 97, (150,), generator=g).tolist(),  # the long prompt
    )


def test_chunks_beside_a_decoding_stream_keep_the_budget_and_its_outputs(model_dir) -> None:
    short, long = _prompts()
    jobs = [(short, 40, 0), (long, 4, 3)]  # the long prompt arrives while the stream decodes
    paced = _llm(model_dir, BUDGET)
    clock = Modelled(paced)
    got = _serve(paced, jobs)
    fixed = _llm(model_dir, 0)
    want = _serve(fixed, jobs)
    _assert_same(got, want, [short, long], fixed)

    mixed = [(rows, chunks, secs) for rows, chunks, secs in clock.steps if rows and chunks]
    assert len(mixed) > 20  # the long prompt went in small chunks beside the decode row
    for rows, chunks, secs in mixed:
        assert sum(chunks) >= 1
        assert secs <= BUDGET * _step_s(rows, 0) * 1.02, (rows, chunks, secs)
    assert max(sum(c) for _, c, _ in mixed) < CHUNK
    # the fixed-chunk engine's steps beside the stream are far over that budget
    assert max(sum(c) for r, c, _ in Modelled.of(_llm(model_dir, 0), jobs) if r) == CHUNK - 1

    # alone, a paced engine prefills the long prompt in full chunks
    steps = Modelled.of(_llm(model_dir, BUDGET), [(long, 2, 0)])
    assert [c for _, c, _ in steps if c] == [[CHUNK], [CHUNK], [150 - 2 * CHUNK]]


def test_snapshots_and_prefix_reuse_with_time_sized_chunks(tmp_path) -> None:
    """A hybrid model (recurrent state) with snapshots every 16 tokens: the chunks the pacer
    cuts still stop at every snapshot point, so a later request sharing 100 tokens of the
    long prompt resumes from its snapshot at 96, as it does after fixed chunks."""
    d = tmp_path / "hybrid"
    make_tiny("qwen3_5_moe", d, seed=23, dtype=torch.bfloat16)
    short, long = _prompts()
    edited = long[:100] + [5, 6, 7]
    outs = {}
    for budget in (BUDGET, 0):
        llm = _llm(d, budget, prefix_cache=True, snapshot_policy="interval:16")
        clock = Modelled(llm)
        first = _serve(llm, [(short, 40, 0), (long, 4, 3)])
        before = llm.engine.stats().prompt_tokens_cached_total
        (again,) = _serve(llm, [(edited, 4, 0)])
        outs[budget] = (first, again, llm.engine.stats().prompt_tokens_cached_total - before)
        chunks = [sum(c) for rows, c, _ in clock.steps if rows and c]
        assert max(chunks) < 8 if budget else max(chunks) == 16, chunks  # cut at 16s
    assert outs[BUDGET][2] == outs[0][2] == 96
    fresh = _llm(d, 0)
    _assert_same([outs[BUDGET][1]], [outs[0][1]], [edited], fresh)
    _assert_same(outs[BUDGET][0], outs[0][0], [short, long], fresh)
