"""A control request in progress (a resize, a switch, a load): a future plus its latest phase.

The admin service streams ``(phase, message)`` changes to ``ftctl`` (progress display) while it
waits for the future.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any


class Ticket:
    def __init__(self, what: str) -> None:
        self.what = what
        self.future: Future[Any] = Future()
        self._lock = threading.Lock()
        self._phase = "queued"
        self._message = f"{what}: queued"
        self._version = 0

    def update(self, phase: str, message: str) -> None:
        with self._lock:
            if (phase, message) != (self._phase, self._message):
                self._phase, self._message = phase, message
                self._version += 1

    def snapshot(self) -> tuple[int, str, str]:
        """(version, phase, message); the version changes with every update."""
        with self._lock:
            return self._version, self._phase, self._message

    def finish(self, result: Any = None) -> None:
        if not self.future.done():
            self.update("done", f"{self.what}: done")
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.update("failed", f"{self.what}: {error}")
            self.future.set_exception(error)

    @property
    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None = None) -> Any:
        """The result (re-raises the failure)."""
        return self.future.result(timeout)
