"""EngineHub: the engine the server's bridge drives; steps the active model and owns safe points.

The bridge's engine thread calls ``step()`` / ``has_unfinished()`` / ``stats()`` as it would on
an EngineCore, and the loop side calls ``add_request`` / ``abort``. The hub forwards them to the
active model's EngineCore (its *lane*) and, between two steps (a *safe point*: no forward step
in flight), runs what the control plane queued:

- operations (cache resizes, a bandwidth bench): each ``attempt()`` either applies at once or
  answers NOT_YET; a NOT_YET operation marked ``drain`` pauses admission on the active lane
  (its ``max_batch`` set to 0: running requests go on, new ones wait) until it applies.
- model switches: the *desired* lane takes new requests at once; the active lane finishes
  everything it has (running and waiting), then ``on_swap(old, new)`` runs (the manager parks
  the old model's device caches and restores the new one's) and the new lane becomes active.

Control calls made while the engine is idle apply in the caller's thread (under the step lock,
so never during a step). Operations run in submission order.

Locks: ``_step`` (held through a whole step and every safe point) and ``_route`` (held only
for the few microseconds of routing a submission, so the event loop never waits for a step).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .lane import Lane
from .ticket import Ticket

if TYPE_CHECKING:
    from ..engine.core import EngineStats, StepOutput
    from ..engine.sampler import SamplingParams
    from ..engine.scheduler import Constraint

_IDLE_WAIT_S = 0.01
NOT_YET = object()  # returned by an operation's attempt() that cannot apply at this safe point


class SwitchSuperseded(RuntimeError):
    """A later switch chose another model before this one took effect."""


@dataclass(eq=False)
class _Op:
    attempt: Callable[[], Any]
    drain: bool
    ticket: Ticket


class EngineHub:
    def __init__(self, lane: Lane, on_swap: Callable[[Lane, Lane], None] | None = None) -> None:
        self._step = threading.RLock()
        self._route = threading.Lock()
        self.active = lane
        self.desired = lane
        self.on_swap = on_swap
        self._routes: dict[str, Lane] = {}  # request id -> lane, set just before bridge.submit
        self._owner: dict[str, Lane] = {}  # request id -> lane, for aborts
        self._ops: collections.deque[_Op] = collections.deque()
        self._switches: list[tuple[Lane, Ticket]] = []
        self._paused: tuple[Lane, int] | None = None  # lane whose admission is paused, max_batch

    # ---- the EngineCore interface the bridge uses ----------------------------------------------
    def route(self, request_id: str, lane: Lane) -> None:
        """The next ``add_request(request_id, ...)`` goes to ``lane`` (its model rendered it)."""
        with self._route:
            self._routes[request_id] = lane

    def unroute(self, request_id: str) -> None:
        with self._route:
            self._routes.pop(request_id, None)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        constraint: Constraint | None = None,
        *,
        checked: bool = False,
    ) -> None:
        with self._route:
            lane = self._routes.pop(request_id, None) or self.desired
            if lane is not self.desired:
                raise ValueError(
                    f"the model {lane.name!r} is being switched out; "
                    f"this daemon now serves {self.desired.name!r}"
                )
            lane.core.add_request(request_id, prompt_ids, params, constraint, checked=checked)
            self._owner[request_id] = lane
        lane.counters.submitted(request_id)

    def abort(self, request_id: str) -> None:
        with self._route:
            lane = self._owner.pop(request_id, None)
        if lane is not None:
            lane.core.abort(request_id)
            lane.counters.forget(request_id)

    def has_unfinished(self) -> bool:
        return bool(
            self._ops
            or self._switches
            or self.active is not self.desired
            or self.active.core.has_unfinished()
        )

    def step(self) -> list[StepOutput]:
        with self._step:
            with self.active.core.device_scope():  # resizes and parking touch the device
                self._safe_point()
            lane = self.active
            outs = lane.core.step()
            if self._ops and not outs and not lane.core.stats().running:
                time.sleep(_IDLE_WAIT_S)  # an operation waits on something other than requests
        if outs:
            lane.counters.outputs(outs)
            with self._route:
                for out in outs:
                    if out.finished:
                        self._owner.pop(out.request_id, None)
        return outs

    def stats(self) -> EngineStats:
        return self.active.core.stats()

    def idle(self) -> None:
        """Idle-time work of the active engine (the serving loop calls it between requests)."""
        with self._step:
            if not self.has_unfinished():
                self.active.core.idle()

    def exclusive(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` with no step in flight (waits for the current one)."""
        with self._step:
            return fn()

    # ---- control side ------------------------------------------------------------------------
    def run_at_safe_point(self, what: str, attempt: Callable[[], Any], drain: bool) -> Ticket:
        """Queue ``attempt`` (applies, or returns NOT_YET); the ticket resolves to its result."""
        op = _Op(attempt, drain, Ticket(what))
        with self._step:
            self._ops.append(op)
            self._safe_point()
        return op.ticket

    def switch_to(self, lane: Lane) -> Ticket:
        """Make ``lane`` the active model once the current one has finished its requests."""
        ticket = Ticket(f"switch to {lane.name}")
        with self._route:
            self.desired = lane
        with self._step:
            self._switches.append((lane, ticket))
            self._safe_point()
        return ticket

    # ---- safe point (step lock held, no step in flight) --------------------------------------
    def _safe_point(self) -> None:
        self._run_ops()
        self._maybe_swap()
        self._resolve_switches()

    def _run_ops(self) -> None:
        while self._ops:
            op = self._ops[0]
            try:
                result = op.attempt()
            except BaseException as e:  # reported to the caller, never kills the engine thread
                self._ops.popleft()
                op.ticket.fail(e)
                continue
            if result is NOT_YET:
                if op.drain:
                    self._pause(self.active)
                running = self.active.core.stats().running
                op.ticket.update(
                    "waiting", f"{op.ticket.what}: waiting for {running} running request(s)"
                )
                break
            self._ops.popleft()
            op.ticket.finish(result)
        if not any(op.drain for op in self._ops):
            self._resume()

    def _pause(self, lane: Lane) -> None:
        if self._paused is None:
            self._paused = (lane, lane.core.max_batch)
            lane.core.max_batch = 0  # Scheduler.admit stops; running requests go on

    def _resume(self) -> None:
        if self._paused is not None:
            lane, max_batch = self._paused
            lane.core.max_batch = max_batch
            self._paused = None

    def _maybe_swap(self) -> None:
        old, new = self.active, self.desired
        if old is new or old.core.has_unfinished() or self._ops:
            return
        self._resume()
        try:
            if self.on_swap is not None:
                self.on_swap(old, new)
        except BaseException as e:
            with self._route:
                self.desired = old
            for lane, ticket in self._switches:
                if lane is new:
                    ticket.fail(e)
            self._switches = [(lane, t) for lane, t in self._switches if not t.done]
            return
        self.active = new

    def _resolve_switches(self) -> None:
        keep = []
        for lane, ticket in self._switches:
            if lane is self.active and lane is self.desired:
                ticket.finish(lane.name)
            elif lane is not self.desired:
                ticket.fail(SwitchSuperseded(f"superseded by a switch to {self.desired.name}"))
            else:
                st = self.active.core.stats()
                ticket.update(
                    "draining",
                    f"waiting for {st.running + st.waiting} request(s) on {self.active.name}",
                )
                keep.append((lane, ticket))
        self._switches = keep
