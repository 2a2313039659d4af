"""What the layers above need of one model's engine, as Protocols (``EngineCore`` implements it).

The manager's engine hub drives each resident model's engine through :class:`ServingEngine`
(``manager/lane.py``, ``manager/hub.py``); the protocol lives here, below the manager, so the
hub names what it uses without depending on ``EngineCore`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    from .core import EngineCore, EngineStats, StepOutput
    from .sampler import SamplingParams
    from .scheduler import Constraint


class StepEngine(Protocol):
    """An engine stepped by one thread: requests in, one step at a time, stats out (what the
    server's bridge drives, and the core of what the hub drives)."""

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        constraint: Constraint | None = None,
        *,
        checked: bool = False,
    ) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[StepOutput]: ...

    def stats(self) -> EngineStats: ...


class ServingEngine(StepEngine, Protocol):
    """One model's engine as the hub drives it: a ``StepEngine`` whose admission the hub can
    pause and whose device work it can enter between steps."""

    # requests admitted per step; the hub sets it to 0 to pause admission for an operation
    max_batch: int
    # the device context a safe point's work runs in (resizes and parking touch the device)
    device_scope: Callable[[], AbstractContextManager[Any]]

    def idle(self) -> None: ...


if TYPE_CHECKING:  # mypy checks here that EngineCore implements the protocol

    def _engine_core(core: EngineCore) -> ServingEngine:
        return core
