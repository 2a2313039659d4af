"""Scheduler: which requests share the next forward step, what each one feeds, and their KV pages.

The engine core (``core.EngineCore``) asks it for one *step plan* per step, runs the plan through
the runner, samples, and hands finished requests back (``finish``).

A step plan (``StepPlan``) is the list of ``Scheduled`` items of one forward step, one per
request that takes part: the tokens it feeds after what its ``SeqState`` already holds, and
whether the step samples its next token. A decoding request feeds its last token and samples;
a prefilling one feeds a chunk of its prompt (or of its recomputed tokens after a preemption)
and samples only when the chunk reaches its end. Decode rows come first, then prompt chunks,
shortest remaining first, within ``max_step_tokens`` tokens in all; beside decode rows the
prompt tokens are further held to what the ``StepPacer`` (engine/pacing.py) allows, so the step
stays within its time budget (a decoding stream's inter-token latency stays bounded while a
long prompt prefills). Every item's KV pages are reserved before the plan is returned.

State it keeps: the waiting queue (admitted oldest first, up to ``max_batch`` running), the
running list (in admission order; the newest is preempted first when the KV pool runs short:
its cache is dropped and it goes back to the head of the queue, to be recomputed from its
prompt and the tokens it already produced), and the counters of prompt positions restored from
the prefix cache and computed by the model.

It runs in the engine thread only; the core's locked inbox hands it requests and aborts.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import torch

from ..kv.pool import KVPoolFull
from ..kv.seq_state import SeqState
from .pacing import StepPacer
from .prefix import PrefixReuse
from .runner import ModelRunner
from .sampler import SamplingParams


class Constraint(Protocol):
    def fill_mask(self, logits: torch.Tensor) -> None:
        """In place on logits [V]: disallowed tokens -> -inf."""

    def accept(self, token_id: int) -> None: ...

    def is_terminated(self) -> bool: ...


@dataclass
class Request:
    """One request in the engine: its prompt, sampling and what it produced so far."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    constraint: Constraint | None
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    state: SeqState | None = None  # its KV and recurrent state while running
    # Prompt tokens never computed for this request: restored at its first admission, lowered
    # if a re-admission after a preemption restored less (its own pages do not count as cached).
    cached: int = 0
    admitted: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Scheduled:
    """One request's share of a step: feed ``tokens`` after what ``state`` holds; ``sample``:
    the step samples the request's next token (its logits row is wanted)."""

    req: Request
    state: SeqState  # req.state, the state the step feeds
    tokens: list[int]
    sample: bool
    decode: bool = False  # a decode row (the request's last token), not a prompt chunk


StepPlan: TypeAlias = list[Scheduled]


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        max_batch: int,
        max_step_tokens: int,
        prefix: PrefixReuse | None = None,
        pacer: StepPacer | None = None,
    ) -> None:
        self.runner = runner
        self.max_batch = max_batch  # 0 pauses admission; running requests go on
        self.max_step_tokens = max_step_tokens
        self.prefix = prefix
        self.pacer = pacer  # sizes prompt chunks beside decode rows by time (None: by tokens)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.cached_total = 0  # prompt positions restored from the prefix cache
        self.computed_total = 0  # prompt positions fed to the model (recomputed ones too)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_in_use(self) -> int:
        """KV pages held by the running requests (any thread: reads a copy of the list)."""
        return len({p for r in list(self.running) if r.state is not None for p in r.state.pages})

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        """Drops the request wherever it is, releasing its pages."""
        for req in list(self.running):
            if req.rid == rid:
                self.running.remove(req)
                self._free(req)
        self.waiting = collections.deque(r for r in self.waiting if r.rid != rid)

    def finish(self, req: Request) -> None:
        """The request ended (finished, failed or cut short): it leaves, its pages are freed."""
        if req in self.running:
            self.running.remove(req)
        self._free(req)

    def admit(self) -> None:
        """Moves waiting requests to the running list up to ``max_batch``, each with a new state
        and its cached prefix restored."""
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting.popleft()
            req.state = self.runner.new_state()
            if self.prefix is not None:
                cached = min(self.prefix.restore(req.tokens, req.state), len(req.prompt))
                if not req.admitted or cached < req.cached:
                    # Positions [cached, req.cached) will be computed now: no longer cached.
                    self.cached_total += cached - req.cached
                    req.cached = cached
            req.admitted = True
            self.running.append(req)

    def schedule(self) -> StepPlan:
        """The next step's plan over the running requests, its KV pages reserved (preempting the
        newest requests while the pool is short). Raises KVPoolFull when not even one request
        fits the pool."""
        plan = self._reserve(self._plan())
        for s in plan:  # prompt positions this step computes
            start = s.state.num_tokens
            self.computed_total += max(0, min(start + len(s.tokens), len(s.req.prompt)) - start)
        return plan

    def _free(self, req: Request) -> None:
        if req.state is not None:
            if self.prefix is not None:
                self.prefix.release(req.tokens, req.state)
            self.runner.release(req.state)
            req.state = None

    def _plan(self) -> StepPlan:
        """Decode rows first (one token each), then prompt chunks within the token budget,
        shortest remaining prompt first: a short request (an agent's title or a quick tool
        turn) is not held behind another's long prefill, which only loses its short share.
        Beside decode rows, the pacer may hold the prompt tokens to fewer (its time budget)."""
        plan: StepPlan = []
        budget = self.max_step_tokens
        prefills: list[tuple[int, Request, SeqState]] = []
        for req in self.running:
            state = req.state
            assert state is not None
            toks = req.tokens
            left = len(toks) - state.num_tokens
            if left == 1:
                plan.append(Scheduled(req, state, toks[-1:], True, decode=True))
                budget -= 1
            elif left > 1:
                prefills.append((left, req, state))
        if self.pacer is not None and plan and prefills:
            budget = self.pacer.prefill_tokens(len(plan), budget)
        prefills.sort(key=lambda p: p[0])  # stable: equal lengths keep their arrival order
        for _, req, state in prefills:
            toks, fed = req.tokens, state.num_tokens
            if budget > 0:
                end = fed + min(budget, len(toks) - fed)
                if self.prefix is not None:  # stop at a snapshot point to capture the state there
                    end = self.prefix.chunk_end(toks, fed, end, state)
                plan.append(Scheduled(req, state, toks[fed:end], end == len(toks)))
                budget -= end - fed
        return plan

    def _reserve(self, plan: StepPlan) -> StepPlan:
        """Takes KV pages for the plan, preempting the newest requests while the pool is short."""
        kv = self.runner.kv
        while True:
            need = 0
            for s in plan:
                need += self.runner.pages_missing(s.state, s.state.num_tokens + len(s.tokens))
            if need > kv.num_free and self.prefix is not None:
                self.prefix.evict(need - kv.num_free)
            if need <= kv.num_free:
                for s in plan:
                    self.runner.reserve(s.state, s.state.num_tokens + len(s.tokens))
                return plan
            if len(self.running) <= 1:
                raise KVPoolFull("the KV pool cannot hold a single request of this length")
            victim = self.running.pop()
            self._free(victim)
            self.waiting.appendleft(victim)
            self.preemptions += 1
            plan = [s for s in plan if s.req is not victim]
