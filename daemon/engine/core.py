"""EngineCore: continuous batching over the ModelRunner.

Requests share forward steps: each `step()` asks the scheduler (`scheduler.Scheduler`) for a
step plan (one token of every decoding request plus chunks of waiting prompts, up to a token
budget, their KV pages reserved; when the pool runs dry the most recently admitted request is
preempted), runs it through the runner, samples where a sequence reached its end, and reports
one StepOutput per sampled token. With ``mixed_step_budget`` set, each step's time (``clock``)
feeds the scheduler's ``StepPacer``, which sizes the prompt chunks beside decode rows by time.

Thread model: `step()` runs in one engine thread. `add_request` and `abort` may be called from
any thread; they validate at once and hand the request over through a locked inbox.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import msgspec
import torch

from ..kv.pool import KVPoolFull
from ..native import dense_native
from ..runtime.staging import to_device
from .pacing import StepPacer
from .prefix import PrefixReuse
from .row_guard import fill_masks, sample_rows
from .runner import ModelRunner, Work
from .sampler import SamplingParams, logprobs_of
from .scheduler import Constraint, Request, Scheduler, StepPlan

log = logging.getLogger(__name__)

NO_TOKEN = -1  # StepOutput.token_id of a finish notice that carries no token


class StepOutput(msgspec.Struct):
    request_id: str
    token_id: int  # the sampled token, or NO_TOKEN
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "error" (then ``error`` says why)
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None  # this request alone failed (its grammar or sampling raised)


class EngineStats(msgspec.Struct):
    running: int
    waiting: int
    kv_pages_used: int  # pages held by requests in flight
    kv_pages_total: int
    kv_pages_cached: int = 0  # pages held only by the prefix cache (reusable, evictable)
    expert_hits: int = 0
    expert_misses: int = 0
    prompt_tokens_cached_total: int = 0
    prompt_tokens_computed_total: int = 0  # prompt positions fed to the model (recomputed ones too)
    generated_tokens_total: int = 0
    preemptions_total: int = 0


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        eos_token_ids: frozenset[int] | set[int],
        max_model_len: int,
        max_batch: int = 32,
        max_step_tokens: int = 512,
        prefix: PrefixReuse | None = None,
        spill_idle_s: float = 2.0,
        mixed_step_budget: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``mixed_step_budget``: a step with decode rows takes about this many times a
        decode-only step (its prompt chunk sized by the measured step times; 0: prompt chunks
        fill ``max_step_tokens`` whatever decodes beside them). ``clock``: seconds, the step
        times' source (tests inject one)."""
        self.runner = runner
        pacer = StepPacer(mixed_step_budget) if mixed_step_budget else None
        self.scheduler = Scheduler(runner, max_batch, max_step_tokens, prefix, pacer)
        self.clock = clock
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._lock = threading.Lock()
        self._generated = 0
        self.spill_idle_s = spill_idle_s  # idle(): seconds without work before snapshots spill
        self._busy_at = time.monotonic()
        self._spill_tried_at: float | None = None  # the _busy_at of the last idle spill attempt
        # entered around each step (and the hub's safe-point operations) in the stepping
        # thread: the fake CUDA device's per-thread modes (LLM(accelerator="fake-cuda"))
        self.device_scope: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext

    # The scheduler's settings, read and set through the core (the hub pauses admission by
    # setting max_batch to 0; tests swap the prefix cache).
    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    @max_batch.setter
    def max_batch(self, n: int) -> None:
        self.scheduler.max_batch = n

    @property
    def max_step_tokens(self) -> int:
        return self.scheduler.max_step_tokens

    @max_step_tokens.setter
    def max_step_tokens(self, n: int) -> None:
        self.scheduler.max_step_tokens = n

    @property
    def prefix(self) -> PrefixReuse | None:
        return self.scheduler.prefix

    @prefix.setter
    def prefix(self, prefix: PrefixReuse | None) -> None:
        self.scheduler.prefix = prefix

    # ---- called from any thread -------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        constraint: Constraint | None = None,
        *,
        checked: bool = False,
    ) -> None:
        """Queue a request; ValueError when it cannot run.

        ``checked``: the caller already range-checked ``params`` and fitted ``max_tokens`` to
        the context with this prompt (the HTTP server does, once, at its edge:
        ``ModelService.check_limits`` and ``fit_context``), so they are not checked again.
        Without it (the offline API, ``LLM.generate``, and direct callers) the engine guards
        itself: ``SamplingParams.validate()`` and prompt + max_tokens within the context. The
        prompt's own checks (not empty, ids in the vocabulary) run for every caller."""
        if not checked:
            self._check_limits(len(prompt_ids), params)
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.runner.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        gen = self.runner.placement.generator(params)  # where the logits are sampled
        req = Request(request_id, list(prompt_ids), params, constraint, gen)
        with self._lock:
            self._inbox.append(("add", req))

    def _check_limits(self, n_prompt: int, params: SamplingParams) -> None:
        """The offline API's guard (the server checks its requests at its edge)."""
        params.validate()
        if n_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the context ({self.max_model_len})"
            )

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox) or self.scheduler.has_work()

    def stats(self) -> EngineStats:
        kv = self.runner.kv
        sched = self.scheduler
        cached = sched.prefix.radix.cached_pages() if sched.prefix is not None else 0
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_pages_used=sched.pages_in_use(),
            kv_pages_total=kv.num_pages,
            kv_pages_cached=cached,
            prompt_tokens_cached_total=sched.cached_total,
            prompt_tokens_computed_total=sched.computed_total,
            generated_tokens_total=self._generated,
            preemptions_total=sched.preemptions,
        )

    # ---- engine thread ----------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, item in items:
            if kind == "add":
                assert isinstance(item, Request)
                self.scheduler.add(item)
            else:
                self.scheduler.abort(str(item))

    def idle(self) -> None:
        """Work for an idle engine; the serving loop calls it between requests. Once idle for
        ``spill_idle_s``, writes new session snapshots to disk (a crash loses at most the
        snapshots of the last few seconds; shutdown writes the rest)."""
        prefix = self.scheduler.prefix
        if self.scheduler.has_work() or self._inbox or prefix is None:
            return
        if time.monotonic() - self._busy_at < self.spill_idle_s or not prefix.unspilled():
            return
        if self._spill_tried_at == self._busy_at:
            return  # one attempt per idle period (a full disk is not retried every second)
        self._spill_tried_at = self._busy_at
        report = prefix.spill_now()
        if report is not None and report.files:
            log.info(
                "spilled %d session snapshot(s): %d MiB in %.2f s",
                report.files,
                report.bytes >> 20,
                report.seconds,
            )

    def step(self) -> list[StepOutput]:
        with self.device_scope():
            return self._step()

    def _step(self) -> list[StepOutput]:
        sched = self.scheduler
        self._drain_inbox()
        sched.admit()
        if not sched.running:
            return []
        self._busy_at = time.monotonic()
        started = self.clock()
        try:
            plan = sched.schedule()
        except KVPoolFull:
            return [self._finish_now(sched.running[0], "length")]
        if not plan:
            return []
        logits = self.runner.forward([Work(s.state, s.tokens, s.sample) for s in plan])
        if sched.prefix is not None:
            for s in plan:
                sched.prefix.after_forward(s.req.tokens, s.state, len(s.req.prompt))
        outs = self._sample([s.req for s in plan if s.sample], logits)
        if sched.pacer is not None:
            sched.pacer.observe(*_shares(plan), self.clock() - started)
        self._busy_at = time.monotonic()
        return outs

    def _finish_now(self, req: Request, reason: str) -> StepOutput:
        self.scheduler.finish(req)
        # NO_TOKEN: the request ends without a new token (its KV no longer fits).
        return StepOutput(req.rid, NO_TOKEN, None, None, True, reason, len(req.prompt), req.cached)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        """One token per request in ``reqs`` (logits [B, V], row i for reqs[i]). A failure in
        one request's grammar, sampling or logprobs ends that request alone (row_guard).

        Logits on a device are sampled there; the host reads the token ids (one copy). Grammar
        masks are applied where the logits are (a constraint sends its bitmask there: a host ->
        device copy, no sync); logprobs cost one more read. A host batch of greedy requests
        with neither takes one native argmax (_greedy_ids), the pick sample_rows makes.
        """
        place = self.runner.placement
        greedy = None if place.on_device else _greedy_ids(reqs, logits)
        if greedy is not None:  # the common CPU decode: no masks, generators or logprobs
            return self._emit(reqs, greedy, {}, {})
        errors = fill_masks([r.constraint for r in reqs], logits)
        ids: list[int | None] = [None] * len(reqs)
        live = [i for i in range(len(reqs)) if i not in errors]
        if live:
            sub = logits
            if len(live) != len(reqs):
                sub = logits[to_device(torch.tensor(live, dtype=torch.long), logits.device)]
            got, bad = sample_rows(
                sub,
                [reqs[i].params for i in live],
                [reqs[i].generator for i in live],
                place.fetch,
                host=not place.on_device,
            )
            for j, i in enumerate(live):
                ids[i] = got[j]
                if j in bad:
                    errors[i] = bad[j]
        return self._emit(reqs, ids, errors, self._logprobs(reqs, logits, ids, errors))

    def _emit(
        self,
        reqs: list[Request],
        ids: Sequence[int | None],
        errors: dict[int, str],
        lp: dict[int, tuple[float, list[tuple[int, float]]]],
    ) -> list[StepOutput]:
        """Each request's step output from its sampled token (None or a row of ``errors``:
        that request fails alone) and its logprobs, its grammar told the token."""
        outs = []
        for i, req in enumerate(reqs):
            tok = ids[i]
            if tok is not None and i not in errors and req.constraint is not None:
                try:
                    req.constraint.accept(tok)
                except Exception as e:
                    errors[i] = f"the grammar failed for this request: {type(e).__name__}: {e}"
            if tok is None or i in errors:
                outs.append(self._fail(req, errors.get(i, "sampling failed")))
                continue
            req.output.append(tok)
            self._generated += 1
            reason = self._finish_reason(req, tok)
            if reason is not None:
                self.scheduler.finish(req)
            chosen_lp, top = lp.get(i, (None, None))
            outs.append(
                StepOutput(
                    req.rid,
                    tok,
                    chosen_lp,
                    top,
                    reason is not None,
                    reason,
                    len(req.prompt),
                    req.cached,
                )
            )
        return outs

    def _logprobs(
        self,
        reqs: list[Request],
        logits: torch.Tensor,
        ids: list[int | None],
        errors: dict[int, str],
    ) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """{row: (chosen logprob, top pairs)} for the rows that asked; a failure here fails
        those rows (recorded in ``errors``), not the batch."""
        want = [
            i
            for i, r in enumerate(reqs)
            if r.params.logprobs is not None and ids[i] is not None and i not in errors
        ]
        if not want:
            return {}
        out: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        try:
            top_n = max(int(reqs[i].params.logprobs or 0) for i in want)
            # the rows and their tokens in one asynchronous copy (no host sync before the read)
            sent = to_device(
                torch.tensor(want + [ids[i] or 0 for i in want], dtype=torch.long), logits.device
            )
            chosen, top_ids, top_lp = logprobs_of(
                logits[sent[: len(want)]], sent[len(want) :], top_n
            )
            if self.runner.placement.on_device:  # one read for the three (fp64 holds ids exactly)
                k = top_ids.shape[1]
                packed = torch.cat([chosen[:, None].double(), top_lp.double(), top_ids.double()], 1)
                host = self.runner.placement.fetch(packed)
                chosen, top_lp, top_ids = (
                    host[:, 0].float(),
                    host[:, 1 : 1 + k].float(),
                    host[:, 1 + k :].long(),
                )
            for j, i in enumerate(want):
                n = int(reqs[i].params.logprobs or 0)
                pairs = list(zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist(), strict=True))
                out[i] = (float(chosen[j]), pairs)
        except Exception as e:
            log.warning("logprobs failed", exc_info=True)
            for i in want:
                errors[i] = f"logprobs failed for this request: {type(e).__name__}: {e}"
        return out

    def _fail(self, req: Request, why: str) -> StepOutput:
        """End one request with an error; the rest of the batch goes on."""
        log.warning("request %s failed alone: %s", req.rid, why)
        self.scheduler.finish(req)
        return StepOutput(
            req.rid, NO_TOKEN, None, None, True, "error", len(req.prompt), req.cached, error=why
        )

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if req.constraint is not None and req.constraint.is_terminated():
            return "stop"
        if len(req.output) >= p.max_tokens or len(req.tokens) >= self.max_model_len:
            return "length"
        return None


def _shares(plan: StepPlan) -> tuple[int, int]:
    """(decode rows, prompt tokens) of a step plan."""
    rows = sum(1 for s in plan if s.decode)
    return rows, sum(len(s.tokens) for s in plan if not s.decode)


def _greedy_ids(reqs: list[Request], logits: torch.Tensor) -> list[int] | None:
    """The next token of every row of host ``logits`` when each request is greedy with no
    grammar and no logprobs (one native argmax, what ``sample_rows`` would pick), else None."""
    if not reqs:  # a step of prefill chunks alone
        return []
    for r in reqs:
        p = r.params
        if not p.greedy or r.constraint is not None or p.logprobs is not None:
            return None
    ids = dense_native.argmax(logits)
    return None if ids is None else ids.tolist()
