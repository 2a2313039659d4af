"""Counts what a fake CUDA run would cost: device bytes (against a simulated card) and host syncs.

A ``TorchDispatchMode`` sees every aten op. Device memory: each op output on ``cuda`` whose
storage is new is an allocation (rounded up to the caching allocator's 512-byte blocks); a
storage is freed when torch frees it (a weak reference to the storage expires). Before each
allocation the expired storages are swept, so ``peak`` is exact at every allocation, and an
allocation beyond the card raises ``torch.OutOfMemoryError`` as CUDA would.

Host syncs: an op that needs device data on the host: a device -> host copy (``.cpu()``,
``.to("cpu")``, ``copy_`` into a host tensor; kind ``d2h``), a scalar read (``.item()``,
``int(t)``), or an op whose output shape depends on device data (``nonzero``, ``unique``,
boolean-mask indexing...). And a blocking host -> device copy (kind ``h2d``): ``torch.tensor(data,
device="cuda")``, ``.to("cuda")`` or ``copy_`` from host memory without ``non_blocking``, or
from pageable memory with it. On CUDA such a copy returns once it is done, which waits for the
work queued before it on the stream: the host stalls as it does for a read. Only a
``non_blocking`` copy from pinned memory is asynchronous; pinned sources are those marked with
``DeviceTracker.pin`` (the CPU build of torch has no pinned allocator; ``runtime.staging`` marks
its buffers so) or that report ``is_pinned()``. Such copies are counted apart
(``async_h2d``), not as syncs. The same holds the other way: a ``non_blocking`` copy from the
device into a pinned host tensor is queued (``async_d2h``), and its bytes are the host's only
after an event recorded after it was waited on (``FakeEvent.synchronize``, counted as a sync of
kind ``event``: a host wait, though on a GPU it may be another thread's): a host op other than a
view that reads that tensor before the wait raises, as it would read stale bytes on CUDA. Each is counted with
a label. The fake tensors hold no data, so scalar reads still raise (the
fake mode's ``DataDependentOutputException``), while data-dependent shapes get their worst case
(every element selected) so that memory is an upper bound.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

aten = torch.ops.aten
MIB = 1 << 20
BLOCK = 512  # the CUDA caching allocator rounds every block up to 512 bytes

# ops whose output size depends on the input's values: a device sync on CUDA
_DYNAMIC = {
    aten.nonzero.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
}


def _is_cuda(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _is_host(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


@dataclass
class SyncLog:
    """Host syncs seen, by kind (``d2h``, ``h2d``, ``scalar``, ``nonzero``...): ``total`` is
    every kind; ``reads`` the syncs that bring device data to the host (all but ``h2d``)."""

    total: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str) -> None:
        self.total += 1
        self.by_kind[kind] += 1

    @property
    def h2d(self) -> int:
        """Blocking host -> device copies."""
        return self.by_kind["h2d"]

    @property
    def reads(self) -> int:
        """Syncs that read device data on the host (``d2h``, scalars, dynamic shapes)."""
        return self.total - self.h2d


OpEntry = tuple[str, tuple[Any, ...], tuple[Any, ...]]


class OpRecorder:
    """The device ops of a stretch of code, in order: (op, what its inputs are, its outputs'
    (shape, dtype)). An input is described by its kind, not its value: a device tensor by
    (shape, dtype), a host tensor by ``"host"`` and its shape (a copy from the host inside a
    CUDA graph replays from the captured address), and a plain number or list by its value,
    since a graph bakes it in (a page index or slice bound that changes per step makes the op
    differ between steps, as it would make a captured graph wrong). Two steps with equal
    ``entries`` have a static shape path: one captured graph replays either of them."""

    def __init__(self) -> None:
        self.entries: list[OpEntry] = []

    def add(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        flat = tree_flatten((args, kwargs))[0]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not any(_is_cuda(t) for t in (*flat, *outs)):
            return  # host work: not part of what a graph replays
        ins = tuple(_describe(a) for a in flat)
        self.entries.append((str(func), ins, tuple(_describe(t) for t in outs)))

    def __len__(self) -> int:
        return len(self.entries)

    def first_difference(self, other: OpRecorder) -> str | None:
        """None when both recorded the same sequence; else where and how they part."""
        for i, (a, b) in enumerate(zip(self.entries, other.entries, strict=False)):
            if a != b:
                return f"op {i}: {a} != {b}"
        if len(self.entries) != len(other.entries):
            n = min(len(self.entries), len(other.entries))
            longer = self.entries if len(self.entries) > n else other.entries
            return f"{len(self.entries)} vs {len(other.entries)} ops; op {n}: {longer[n]}"
        return None

    def host_inputs(self) -> list[OpEntry]:
        """The ops that read a host tensor (an h2d copy, or a host index into the device)."""
        return [e for e in self.entries if any(_is_host_desc(d) for d in e[1])]


def _describe(a: object) -> Any:
    if isinstance(a, torch.Tensor):
        kind = "cuda" if _is_cuda(a) else "host"
        return (kind, tuple(a.shape), str(a.dtype).removeprefix("torch."))
    if isinstance(a, torch.device | torch.dtype | torch.layout | torch.memory_format):
        return str(a)
    return a


def _is_host_desc(d: object) -> bool:
    return isinstance(d, tuple) and len(d) == 3 and d[0] == "host"


class _HostBytes:
    """Live and peak bytes of fake host tensors."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live_bytes = 0
        self.peak = 0

    def sweep(self) -> int:
        for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.live_bytes -= self.live.pop(k)[1]
        return self.live_bytes

    def reset_peak(self) -> None:
        self.peak = self.sweep()

    def note(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if _alive(self.live, st._cdata):
            return
        self.live_bytes = self.sweep() + st.nbytes()
        self.live[st._cdata] = (StorageWeakRef(st), st.nbytes())
        self.peak = max(self.peak, self.live_bytes)


class DeviceTracker(TorchDispatchMode):
    """Device-byte accounting against ``capacity`` bytes, and the host-sync counter."""

    def __init__(self, capacity: int, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.capacity = capacity
        self.fake_mode = fake_mode
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage key -> (ref, bytes)
        self.live_bytes = 0
        self.peak = 0
        self.syncs = SyncLog()
        self.async_h2d = 0  # non_blocking copies from pinned memory: no sync
        self.async_d2h = 0  # non_blocking copies into pinned memory: no sync
        # host storages written by an async d2h whose event nobody waited on yet
        self._arriving: dict[int, StorageWeakRef] = {}
        self._pinned: dict[int, StorageWeakRef] = {}  # storages marked pinned (``pin``)
        # fake host tensors (banks of a model without its weights): counted, never limited
        self.host = _HostBytes()
        self.recorder: OpRecorder | None = None  # ``record()``: the device ops, in order

    # -- memory ------------------------------------------------------------------------------
    def sweep(self) -> int:
        """Forget freed storages; returns the live device bytes."""
        for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.live_bytes -= self.live.pop(k)[1]
        return self.live_bytes

    def reset_peak(self) -> None:
        self.peak = self.sweep()

    def _note(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if _alive(self.live, key):  # a view, or an op writing in place
            return
        nbytes = -(-st.nbytes() // BLOCK) * BLOCK
        live = self.sweep()
        if live + nbytes > self.capacity:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated card). Tried to allocate {nbytes / MIB:.2f} MiB; "
                f"{live / MIB:.2f} MiB in use of {self.capacity / MIB:.2f} MiB usable"
            )
        self.live[key] = (StorageWeakRef(st), nbytes)
        self.live_bytes = live + nbytes
        self.peak = max(self.peak, self.live_bytes)

    # -- pinned host memory -------------------------------------------------------------------
    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """Marks the storage of host tensor ``t`` as pinned (page-locked, as
        ``t.pin_memory()`` makes it on CUDA); returns ``t``."""
        if t.device.type != "cpu":
            raise RuntimeError(f"pin: host tensor expected, got one on {t.device}")
        for k in [k for k, ref in self._pinned.items() if ref.expired()]:
            del self._pinned[k]
        st = t.untyped_storage()
        self._pinned[st._cdata] = StorageWeakRef(st)
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        ref = self._pinned.get(t.untyped_storage()._cdata)
        if ref is not None and not ref.expired():
            return True
        return not isinstance(t, FakeTensor) and bool(t.is_pinned())

    def _h2d(self, src: torch.Tensor, non_blocking: bool) -> None:
        if non_blocking and self.is_pinned(src):
            self.async_h2d += 1
        else:
            self.syncs.add("h2d")

    def arriving(self) -> frozenset[int]:
        """The host storages an event recorded now covers (``FakeEvent.record``)."""
        return frozenset(self._arriving)

    def arrived(self, keys: frozenset[int]) -> None:
        """An event covering ``keys`` was waited on: their bytes are on the host."""
        self.syncs.add("event")
        for k in keys:
            self._arriving.pop(k, None)

    def synchronized(self) -> None:
        """The host waited for the whole device (``torch.cuda.synchronize``, a stream's): a
        sync, after which every queued copy has landed."""
        self.syncs.add("synchronize")
        self._arriving.clear()

    def _check_arrived(self, func: Any, args: tuple, kwargs: dict) -> None:
        for k in [k for k, ref in self._arriving.items() if ref.expired()]:
            del self._arriving[k]
        if not self._arriving:
            return
        # a copy's destination is written, not read (an async copy into it is the arrival)
        reads = args[1:] if func is aten.copy_.default else args
        for t in tree_flatten((reads, kwargs))[0]:
            if _is_host(t) and t.untyped_storage()._cdata in self._arriving:
                raise RuntimeError(
                    f"{func}: reads a host buffer whose asynchronous device -> host copy was "
                    "not waited on (wait on the copy's event first: on CUDA this reads stale "
                    "bytes)"
                )

    # -- recording ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def record(self) -> Iterator[OpRecorder]:
        """Records every op that touches the device while the block runs (``OpRecorder``)."""
        rec, prev = OpRecorder(), self.recorder
        self.recorder = rec
        try:
            yield rec
        finally:
            self.recorder = prev

    # -- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(
        self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._arriving and not _metadata_only(func):
            self._check_arrived(func, args, kwargs)
        self._count_sync(func, args, kwargs)
        if func in _DYNAMIC and _is_cuda(args[0]):
            out = self._worst_case(func, args, kwargs)
        elif func is aten.index.Tensor and _is_cuda(args[0]) and _has_bool(args[1]):
            out = self._bool_index(args[0], args[1])
        elif _on_fake_device(args, kwargs):
            # host tensors among the inputs become fake; converted here, not by the fake mode,
            # which fails to wrap them under ``torch.inference_mode`` (the model's forward)
            args, kwargs = tree_map_only(torch.Tensor, self._fake, (args, kwargs))
            kwargs = _without_generator(func, kwargs)
            with self.fake_mode:
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)  # host-only op: real tensors, real values
        for t in tree_flatten(out)[0]:
            if _is_cuda(t):
                self._note(t)
            elif isinstance(t, FakeTensor):
                self.host.note(t)
        if self.recorder is not None:
            self.recorder.add(func, args, kwargs, out)
        return out

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, FakeTensor) else self.fake_mode.from_tensor(t)

    def _count_sync(self, func: Any, args: tuple, kwargs: dict) -> None:
        if func is aten._local_scalar_dense.default and _is_cuda(args[0]):
            self.syncs.add("scalar")
        elif func in (aten._to_copy.default, aten.to.dtype_layout):
            dev = kwargs.get("device")
            to = None if dev is None else torch.device(dev).type
            if _is_cuda(args[0]) and to == "cpu":
                self.syncs.add("d2h")
            elif _is_host(args[0]) and to == "cuda":
                self._h2d(args[0], bool(kwargs.get("non_blocking", False)))
        elif self._async_d2h(func, args, kwargs):
            self.async_d2h += 1
            st = args[0].untyped_storage()
            self._arriving[st._cdata] = StorageWeakRef(st)
        elif func is aten.copy_.default and _is_cuda(args[1]) and not _is_cuda(args[0]):
            self.syncs.add("d2h")
        elif func is aten.copy_.default and _is_cuda(args[0]) and _is_host(args[1]):
            nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self._h2d(args[1], bool(nb))
        elif func in _DYNAMIC and _is_cuda(args[0]):
            self.syncs.add(str(func.overloadpacket.__name__))
        elif func is aten.index.Tensor and _is_cuda(args[0]) and _has_bool(args[1]):
            self.syncs.add("bool_index")
        elif func is aten.index_put_.default and _is_cuda(args[0]) and _has_bool(args[1]):
            self.syncs.add("bool_index")

    def _async_d2h(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """A ``non_blocking`` copy_ from the device into pinned host memory."""
        if func is not aten.copy_.default or not (_is_cuda(args[1]) and _is_host(args[0])):
            return False
        nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return bool(nb) and self.is_pinned(args[0])

    def _worst_case(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Outputs of a data-dependent op sized as if every element were selected / distinct."""
        x = args[0]
        n = x.numel()
        if func is aten.nonzero.default:
            return x.new_empty((n, x.dim()), dtype=torch.long)
        if func is aten.masked_select.default:
            return x.new_empty((n,))
        if func is aten.bincount.default:
            return x.new_empty((n,), dtype=torch.long)
        if func is aten.repeat_interleave.Tensor:
            return x.new_empty((n,), dtype=torch.long)
        flat = x.new_empty((n,))
        inv = x.new_empty(x.shape, dtype=torch.long)
        return flat, inv, x.new_empty((n,), dtype=torch.long)

    def _bool_index(self, x: torch.Tensor, indices: list) -> torch.Tensor:
        out: list[torch.Tensor | None] = []
        for i in indices:
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                nz = i.new_empty((i.numel(), i.dim()), dtype=torch.long)
                out.extend(aten.select.int(nz, 1, d) for d in range(i.dim()))
            else:
                out.append(i)
        return aten.index.Tensor(x, out)


def _metadata_only(func: Any) -> bool:
    """An op that reads no element of its inputs: a view, or a query of sizes or the device."""
    return bool(func.is_view) or func.namespace == "prim" or func in _METADATA


_METADATA = {
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten.is_pinned.default,
}


def _alive(live: dict[int, tuple[StorageWeakRef, int]], key: int) -> bool:
    """Whether ``key`` names a storage still alive (a freed storage's address can be reused
    by the next allocation before the sweep has forgotten it)."""
    entry = live.get(key)
    return entry is not None and not entry[0].expired()


def _on_fake_device(args: tuple, kwargs: dict) -> bool:
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == "cuda":
        return True
    return any(isinstance(t, FakeTensor) for t in tree_flatten((args, kwargs))[0])


def _without_generator(func: Any, kwargs: dict) -> dict:
    """A random op on the fake device draws nothing: its generator is dropped (torch's fake
    implementations take none). Its device was checked by the shim, which sees the caller's
    generator object (here it arrives re-wrapped, as a plain host generator)."""
    if kwargs.get("generator") is None:
        return kwargs
    return {k: v for k, v in kwargs.items() if k != "generator"}


def _has_bool(indices: list) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
