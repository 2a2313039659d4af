"""A fake CUDA device in this process: the modes of ``shim`` and ``tracker`` plus stand-ins for
the ``torch.cuda`` runtime calls a CPU build of torch lacks.

``with FakeCudaSession(vram_bytes) as s:`` makes ``device="cuda"`` tensors fake (shapes, dtypes
and devices, no data), counts device bytes against the simulated card and host syncs, and
replaces ``torch.cuda.Stream``/``Event``/``current_stream``/``stream``/``synchronize``/
``mem_get_info``/``empty_cache``/``get_device_properties`` and ``torch.Generator`` (see
``generator``) for the duration. Streams are
ordered trivially (the fake copies carry no data); ``synchronize`` counts as a host sync.
Host tensors stay real unless made with ``s.host_empty`` (a fake host tensor: a bank of a model
whose weights were never downloaded).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ...runtime import staging
from .generator import GeneratorFactory
from .shim import DeviceShim
from .tracker import DeviceTracker

_LOCK = threading.Lock()  # the torch.cuda patches are process-wide: one session at a time
_ACTIVE: list[FakeCudaSession] = []  # the open session (at most one)


def active_session() -> FakeCudaSession | None:
    """The open fake session of this process, if any (code that must tell the fake device
    from a real one: ``engine.graphs`` cannot capture on it; ``runtime.staging`` is handed the
    tracker's pin while the session is open)."""
    return _ACTIVE[0] if _ACTIVE else None


class FakeStream:
    """Stand-in for ``torch.cuda.Stream``: every call is accepted, nothing waits."""

    def __init__(self, device: object = None, priority: int = 0) -> None:
        self.device = torch.device("cuda", 0)

    def wait_stream(self, other: FakeStream) -> None:
        pass

    def wait_event(self, event: FakeEvent) -> None:
        pass

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        ev = event or FakeEvent()
        ev.record(self)
        return ev

    def synchronize(self) -> None:
        session = active_session()
        if session is not None:
            session.tracker.synchronized()

    def query(self) -> bool:
        return True


class FakeEvent:
    """Stand-in for ``torch.cuda.Event``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.recorded = False
        self._covers: frozenset[int] = frozenset()

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded = True
        session = active_session()
        # the asynchronous device -> host copies queued before it (the fake device has one
        # stream in order), which a host wait on this event lets the host read
        self._covers = session.tracker.arriving() if session is not None else frozenset()

    def wait(self, stream: FakeStream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        """A host wait: counted as a sync (kind ``event``)."""
        session = active_session()
        if session is not None:
            session.tracker.arrived(self._covers)

    def query(self) -> bool:
        return True


class FakeCudaSession:
    """The fake device: ``capacity`` usable bytes (the card minus the CUDA context)."""

    def __init__(self, total_bytes: int, context_bytes: int = 0) -> None:
        self.total = total_bytes
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.tracker = DeviceTracker(total_bytes - context_bytes, self.fake_mode)
        self.context_bytes = context_bytes
        self._stream = FakeStream()
        self._stack: contextlib.ExitStack | None = None
        self._local = threading.local()
        self._modes: contextlib.AbstractContextManager[None] = contextlib.nullcontext()

    # -- what the fake runtime reports ------------------------------------------------------
    def mem_get_info(self, device: object = None) -> tuple[int, int]:
        """(free, total) bytes as ``torch.cuda.mem_get_info`` reports them."""
        used = self.context_bytes + self.tracker.sweep()
        return max(0, self.total - used), self.total

    @property
    def syncs(self) -> int:
        return self.tracker.syncs.total

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A fake host tensor (no memory behind it)."""
        with self.fake_mode:
            t = torch.empty(shape, dtype=dtype)
        self.tracker.host.note(t)
        return t

    # -- entering ----------------------------------------------------------------------------
    # Two parts: the ``torch.cuda`` patches are process-wide (``open``/``close``, one session at
    # a time); the modes that make device tensors fake and count them are per thread (torch
    # keeps mode stacks per thread), so each thread doing device work enters ``in_thread()``.
    # ``with session:`` is both, for code that runs in one thread (tests, ``ftctl plan``).
    def open(self) -> None:
        """Installs the process-wide ``torch.cuda`` stand-ins until ``close()``."""
        if not _LOCK.acquire(blocking=False):
            raise RuntimeError("a fake CUDA session is already active in this process")
        stack = contextlib.ExitStack()
        try:
            for name, value in self._patches().items():
                stack.enter_context(_patched(torch.cuda, name, value))
            stack.enter_context(_patched(torch, "Generator", GeneratorFactory))
        except BaseException:
            stack.close()
            _LOCK.release()
            raise
        self._stack = stack
        _ACTIVE.append(self)
        staging.set_fake_pin(lambda t: self.tracker.pin(t))

    def close(self) -> None:
        if self._stack is None:
            return
        try:
            self._stack.close()
        finally:
            self._stack = None
            _ACTIVE.clear()
            staging.set_fake_pin(None)
            _LOCK.release()

    @contextlib.contextmanager
    def in_thread(self) -> Iterator[None]:
        """The fake device in the calling thread (re-entrant: a no-op where already active).
        Only one thread at a time may do device work (the fake mode is not thread-safe)."""
        if self._stack is None:
            raise RuntimeError("the fake CUDA session is not open")
        if getattr(self._local, "active", False):
            yield
            return
        self._local.active = True
        try:
            with DeviceShim(self.fake_mode), _TrackerView(self.tracker):
                yield
        finally:
            self._local.active = False

    def __enter__(self) -> FakeCudaSession:
        self.open()
        try:
            self._modes = self.in_thread()
            self._modes.__enter__()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._modes.__exit__(None, None, None)
        finally:
            self.close()

    def _patches(self) -> dict[str, Any]:
        def synchronize(device: object = None) -> None:
            self.tracker.synchronized()

        @contextlib.contextmanager
        def stream(s: object) -> Iterator[None]:
            yield

        props = SimpleNamespace(
            name="fake-cuda", total_memory=self.total, major=8, minor=9, multi_processor_count=1
        )
        return {
            "_lazy_init": lambda: None,
            "Stream": FakeStream,
            "Event": FakeEvent,
            "current_stream": lambda device=None: self._stream,
            "default_stream": lambda device=None: self._stream,
            "stream": stream,
            "synchronize": synchronize,
            "mem_get_info": self.mem_get_info,
            "empty_cache": lambda: None,
            "current_device": lambda: 0,
            "device_count": lambda: 1,
            "get_device_properties": lambda device=None: props,
        }


class _TrackerView(TorchDispatchMode):
    """The session's tracker as a mode of one thread: each thread pushes its own mode object
    (a mode keeps per-entry state), all of them count into the one tracker."""

    def __init__(self, tracker: DeviceTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(
        self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return self.tracker.__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def _patched(obj: object, name: str, value: object) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
