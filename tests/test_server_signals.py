"""The SIGTERM handler only sets flags. A signal handler runs in the main thread between two
bytecodes of whatever it interrupted, e.g. inside the logger holding its (non-reentrant) lock:
the drain used to log from the handler and deadlocked the daemon when SIGTERM landed while a
request was being logged (found as a rare hang of test_admission_limit_then_sigterm_drain, then
caught with py-spy: the main thread inside PrintLogger.msg, twice)."""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace
from typing import Any

import uvicorn

from freetokend.server import run


def test_drain_is_announced_from_the_event_loop_not_the_handler(monkeypatch: Any) -> None:
    logged: list[tuple[Any, ...]] = []
    hooks: list[int] = []
    monkeypatch.setattr(run, "log", SimpleNamespace(info=lambda *a, **k: logged.append(a)))
    state: Any = SimpleNamespace(
        draining=False,
        bridge=SimpleNamespace(in_flight=1),
        extra={"on_draining": lambda: hooks.append(1)},
    )
    server = run.DrainingServer(uvicorn.Config(app=None), state, drain_timeout=30)

    server.handle_exit(signal.SIGTERM, None)
    assert state.draining and not server.should_exit
    assert logged == [] and hooks == []  # nothing that takes a lock in the handler

    assert asyncio.run(server.on_tick(1)) is False  # a request in flight: keep serving
    assert logged == [("draining",)] and hooks == [1]
    assert asyncio.run(server.on_tick(2)) is False
    assert len(logged) == 1 and hooks == [1]  # announced once

    state.bridge.in_flight = 0
    assert asyncio.run(server.on_tick(3)) is True  # drained: stop

    server.handle_exit(signal.SIGINT, None)  # a second signal stops at once
    assert server.should_exit and server.force_exit and len(logged) == 1
