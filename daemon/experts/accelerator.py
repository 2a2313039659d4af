"""Accelerator interface: device memory, an asynchronous host->device transfer path, and events.

Two implementations:
- ``CudaAccelerator``: a dedicated transfer stream; copies come from pinned host memory with
  ``non_blocking=True``; the compute stream waits on an event recorded after the copies. A copy
  list that lives on the device (``fill_rows``) runs as a Triton kernel reading the pinned,
  mapped host pool in place, so decode never waits for the host to learn what to copy.
- ``StandinAccelerator``: a CPU stand-in for CI. Its "device" tensors are separate CPU tensors
  and a queue plays the transfer stream: a copy lands only when compute waits on it (or on a later
  one), so every mechanism built on this interface (slot fills, double-buffered prefill, the
  hybrid split) runs without a GPU, and a missing wait shows as wrong output.
"""

from __future__ import annotations

import logging
import random
import threading
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..runtime import pinning

log = logging.getLogger(__name__)

# (device bank, host bank, device rows, host rows): dst[d] <- src[s] for the listed rows
RowCopies = list[tuple[torch.Tensor, torch.Tensor, list[int], list[int]]]
# (device bank, host bank) of each tensor of an expert format
BankPairs = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TransferStats:
    copies: int = 0
    bytes: int = 0
    # transfers the caller went on from before they landed (stand-in only: all of its waits)
    overlapped: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Transfer(ABC):
    """A handle on copies in flight."""

    @abstractmethod
    def wait(self) -> None:
        """Make subsequent compute see the copied data."""

    def landed(self) -> bool:
        """Whether the copies have run (their host sources may be overwritten); no wait."""
        return False

    def host_wait(self) -> None:
        """Block the calling thread until the copies have run (the disk tier waits so before
        a read overwrites a RAM slot a fill may still read: device_tier)."""
        raise NotImplementedError


class HostCopy(ABC):
    """A handle on a device -> host copy in flight (``Accelerator.to_host_async``)."""

    @abstractmethod
    def wait(self) -> None:
        """Block the calling thread until the host buffer holds the copied bytes."""


class _Landed(HostCopy):
    def wait(self) -> None:
        pass


class _Deferred(HostCopy):
    """The stand-in's queued device -> host copy: it lands when a thread waits for it, so a read
    of the buffer before the wait sees the buffer's poison, not the data."""

    def __init__(self, job: Callable[[], object]) -> None:
        self._job: Callable[[], object] | None = job
        self._lock = threading.Lock()

    def wait(self) -> None:
        with self._lock:
            if self._job is not None:
                self._job()
                self._job = None


class _EventCopy(HostCopy):
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()  # this thread waits; the stream and other threads go on


class Accelerator(ABC):
    name: str
    device: torch.device

    def __init__(self) -> None:
        self.stats = TransferStats()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, copy=True)

    def to_host(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A layer's output back to where its input lives (``device``: the host while dense
        layers run there): a device -> host copy, the host sync the fake device counts."""
        return t.to(device)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor that copies to and from the device use without a host sync
        (page-locked on CUDA). Reused by its owner: allocate once, not per step."""
        return torch.empty(shape, dtype=dtype)

    def to_host_async(self, dst: torch.Tensor, src: torch.Tensor) -> HostCopy:
        """``dst`` (a ``host_buffer`` view) <- ``src`` (on the device), queued after the work
        already on the stream; the caller goes on at once, and whoever reads ``dst`` calls
        ``wait()`` on the handle first (on any thread)."""
        dst.copy_(src)
        return _Landed()

    @abstractmethod
    def copy_rows(self, pairs: RowCopies) -> Transfer:
        """Asynchronously copy rows: for each (dst, src, dst_rows, src_rows), dst[d] <- src[s].

        ``dst`` lives on the device, ``src`` in (pinned) host memory; rows are whole experts.
        """

    def fill_rows(
        self,
        pairs: BankPairs,
        dst_idx: torch.Tensor,
        src_idx: torch.Tensor,
        count: torch.Tensor,
        kernel: bool = False,
    ) -> Transfer:
        """Asynchronously execute a device-side copy list: for each (dst, src) bank pair,
        dst[dst_idx[i]] <- src[src_idx[i]] for i < count[0].

        ``dst_idx``, ``src_idx`` [C] and ``count`` [1] are int32 tensors on the device, as the
        slot cache's decode kernel leaves them: the host never reads them (no sync per layer).
        The caller may drop them as soon as this returns (the transfer holds them).
        ``kernel``: run the Triton copy kernel (always on CUDA; on the stand-in, tests).
        """
        transfer = self._queue_fill(pairs, dst_idx, src_idx, count, kernel)
        self._hold(transfer, (dst_idx, src_idx, count))
        return transfer

    @abstractmethod
    def _queue_fill(
        self,
        pairs: BankPairs,
        dst_idx: torch.Tensor,
        src_idx: torch.Tensor,
        count: torch.Tensor,
        kernel: bool,
    ) -> Transfer:
        """Queue ``fill_rows``'s copies on the transfer path."""

    @abstractmethod
    def _hold(self, transfer: Transfer, tensors: tuple[torch.Tensor, ...]) -> None:
        """Keep the device memory of ``tensors``, which ``transfer`` reads, from being reused
        until the transfer has run. They were made on the compute stream, and the caller may
        drop them when the issuing call returns: a caching allocator then hands their blocks
        to the compute stream's next allocation, which may write them before the transfer
        stream has read them (a prefill layer's copy list, overwritten by the layer's compute:
        wrong experts in the slots, or an illegal address)."""

    def device_fill_ok(self, src: torch.Tensor) -> bool:
        """Whether ``fill_rows`` works from this host bank (checked once per backend)."""
        return True

    def mem_get_info(self) -> tuple[int, int] | None:
        """(free, total) device bytes, or None when the device has no memory limit of its own
        (the stand-in's "device" is host memory)."""
        return None

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """Page-lock a filled host tensor in place where the platform supports it."""
        return t

    def synchronize(self) -> None:  # noqa: B027 (optional hook)
        pass

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the accelerator holds on the host (pinned registrations)."""

    def _count(self, pairs: RowCopies) -> None:
        n = sum(len(d) for _, _, d, _ in pairs)
        b = sum(src[0].numel() * src.element_size() * len(s) for _, src, _, s in pairs if len(s))
        with self.stats.lock:
            self.stats.copies += n
            self.stats.bytes += b


def _do_copies(pairs: RowCopies, rng: random.Random | None = None) -> None:
    for dst, src, drows, srows in pairs:
        rows = list(zip(drows, srows, strict=True))
        if rng is not None:  # rows of one transfer land in no particular order on a GPU
            rng.shuffle(rows)
        for d, s in rows:
            dst[d].copy_(src[s])


def _do_fill(
    pairs: BankPairs,
    dst_idx: torch.Tensor,
    src_idx: torch.Tensor,
    count: torch.Tensor,
    kernel: bool,
    stats: TransferStats,
    rng: random.Random | None = None,
) -> None:
    # deferred: triton (the ftkernels GPU kernels)
    from ftkernels import moe_decode as k  # torch reference and Triton kernel

    n = int(count.reshape(-1)[0])  # the stand-in's "device" is host memory: free to read
    if rng is not None and n > 1:  # the kernel's programs run in no particular order
        order = torch.randperm(n, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        dst_idx, src_idx = dst_idx.clone(), src_idx.clone()
        dst_idx[:n], src_idx[:n] = dst_idx[:n][order], src_idx[:n][order]
    copy = k.copy_rows if kernel else k.copy_rows_reference
    for dst, src in pairs:
        copy(dst, src, dst_idx, src_idx, count)
    with stats.lock:
        stats.copies += n * len(pairs)
        stats.bytes += n * sum(src[0].numel() * src.element_size() for _, src in pairs)


def _poison(t: torch.Tensor) -> None:
    """NaN floats, all-ones bytes (-1 as a signed integer)."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.view(torch.uint8).fill_(0xFF)


class _StreamTransfer(Transfer):
    """A copy queued on the stand-in's transfer stream; ``wait`` is the compute side reaching
    the event recorded after it. ``held``: the inputs kept from reuse until it lands."""

    def __init__(self, acc: StandinAccelerator, job: Callable[[], None]) -> None:
        self.acc, self.job, self.done = acc, job, False
        self.held: tuple[torch.Tensor, ...] = ()

    def wait(self) -> None:
        self.acc._reach(self)

    def landed(self) -> bool:
        return self.done

    def host_wait(self) -> None:
        self.acc._reach(self)  # (the stand-in's stream is the host: landing it is the wait)

    def land(self) -> None:
        self.job()
        self.done, self.held = True, ()


class StandinAccelerator(Accelerator):
    """CPU stand-in for CI that orders copies like a CUDA stream, not like a lock.

    A copy is queued, not run: it lands when the compute side waits on its transfer (or on a
    later one: the stream is FIFO) or at ``synchronize``. Compute that reads a slot without
    waiting therefore sees the old bytes, whatever the timing, and an ordering bug changes the
    output of the equality tests instead of passing by luck.
    ``order="chaos"`` (tests): queued copies may also land early, at any later accelerator call,
    and the rows of one transfer land in a random order, as a GPU allows; correct code gives
    the same output in both modes.
    ``reclaim=True`` (tests): when ``fill_rows`` returns, the copy-list tensors its transfer
    does not hold (``_hold``) are poisoned, as CUDA's caching allocator hands the blocks a
    caller dropped to the compute stream's next allocation before the transfer stream has
    read them; a copy list that is not held then lands wrong experts.
    """

    name = "standin"
    ORDERS = ("stream", "chaos")

    def __init__(self, order: str = "stream", seed: int = 0, reclaim: bool = False) -> None:
        super().__init__()
        if order not in self.ORDERS:
            raise ValueError(f"unknown stand-in order {order!r}; choose one of {self.ORDERS}")
        self.device = torch.device("cpu")
        self.order = order
        self.reclaim = reclaim
        self._rng = random.Random(seed) if order == "chaos" else None
        self._queue: deque[_StreamTransfer] = deque()
        self._lock = threading.RLock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Poisoned, not uninitialised: NaN floats, all-ones bytes. A slot read before its copy
        landed must show, and memory the allocator hands back from a freed bank of the same
        experts would otherwise hold the right weights (a missed wait then passes by luck)."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        _poison(t)
        return t

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype)  # poisoned too: a read before its copy landed shows

    def to_host_async(self, dst: torch.Tensor, src: torch.Tensor) -> HostCopy:
        return _Deferred(lambda: dst.copy_(src))  # lands at wait(), as an event would signal

    def copy_rows(self, pairs: RowCopies) -> Transfer:
        self._count(pairs)
        return self._enqueue(lambda: _do_copies(pairs, self._rng))

    def fill_rows(
        self,
        pairs: BankPairs,
        dst_idx: torch.Tensor,
        src_idx: torch.Tensor,
        count: torch.Tensor,
        kernel: bool = False,
    ) -> Transfer:
        """``Accelerator.fill_rows``, then (``reclaim``) the allocator's view of the caller's
        copy list once the call has returned."""
        transfer = super().fill_rows(pairs, dst_idx, src_idx, count, kernel)
        if self.reclaim:
            self._reclaim(transfer, (dst_idx, src_idx, count))
        return transfer

    def _queue_fill(
        self,
        pairs: BankPairs,
        dst_idx: torch.Tensor,
        src_idx: torch.Tensor,
        count: torch.Tensor,
        kernel: bool,
    ) -> Transfer:
        stats, rng = self.stats, self._rng
        return self._enqueue(lambda: _do_fill(pairs, dst_idx, src_idx, count, kernel, stats, rng))

    def _hold(self, transfer: Transfer, tensors: tuple[torch.Tensor, ...]) -> None:
        assert isinstance(transfer, _StreamTransfer)
        with self._lock:
            if not transfer.done:  # a transfer that landed (chaos) reads nothing any more
                transfer.held += tensors

    def _reclaim(self, transfer: Transfer, inputs: tuple[torch.Tensor, ...]) -> None:
        """Poison the ``inputs`` a still-queued ``transfer`` does not hold: memory the next
        allocation may take and write before the transfer reads it."""
        assert isinstance(transfer, _StreamTransfer)
        with self._lock:
            if transfer.done:
                return
            held = {id(t) for t in transfer.held}
            for t in inputs:
                if id(t) not in held:
                    _poison(t)

    def synchronize(self) -> None:
        with self._lock:
            if self._queue:
                self._reach(self._queue[-1])

    def pending(self) -> int:
        """Copies queued and not landed yet."""
        return len(self._queue)

    def _enqueue(self, job: Callable[[], None]) -> Transfer:
        with self._lock:
            self._land_early()
            t = _StreamTransfer(self, job)
            self._queue.append(t)
            return t

    def _reach(self, t: _StreamTransfer) -> None:
        with self._lock:
            if t.done:
                return
            with self.stats.lock:
                self.stats.overlapped += 1  # the caller went on while the copy was queued
            while self._queue:
                head = self._queue.popleft()
                head.land()
                if head is t:
                    break
            self._land_early()

    def _land_early(self) -> None:
        """chaos: a random prefix of the queue lands now (it may finish before anyone waits)."""
        if self._rng is None or not self._queue:
            return
        for _ in range(self._rng.randrange(len(self._queue) + 1)):
            self._queue.popleft().land()


def _runs(drows: list[int], srows: list[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of the maximal runs where both row lists step by one."""
    out: list[tuple[int, int, int]] = []
    for d, s in zip(drows, srows, strict=True):
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((d, s, 1))
    return out


class _CudaTransfer(Transfer):
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)

    def landed(self) -> bool:
        return bool(self.event.query())

    def host_wait(self) -> None:
        self.event.synchronize()


class CudaAccelerator(Accelerator):
    name = "cuda"

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise RuntimeError("accelerator 'cuda' requested but no CUDA device is available")
        self.device = torch.device("cuda", index)
        self.copy_stream = torch.cuda.Stream(self.device)
        self._pinned: list[weakref.ref[torch.Tensor]] = []

    def copy_rows(self, pairs: RowCopies) -> Transfer:
        self._count(pairs)
        # The destination slots may still be read by compute queued before this call.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        # Nothing to ``_hold``: the row lists are read here on the host, the source is the
        # long-lived pinned pool, and the destination banks outlive every transfer.
        with torch.cuda.stream(self.copy_stream):
            for dst, src, drows, srows in pairs:
                # one copy per run of consecutive rows (a prefill layer is one run)
                for d, s, n in _runs(drows, srows):
                    # a view of pinned memory
                    dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        return _CudaTransfer(ev)

    def _queue_fill(
        self,
        pairs: BankPairs,
        dst_idx: torch.Tensor,
        src_idx: torch.Tensor,
        count: torch.Tensor,
        kernel: bool,
    ) -> Transfer:
        # deferred: triton (the ftkernels GPU kernels)
        from ftkernels.ops import copy_rows

        # SMs read the pinned, mapped host pool over PCIe (zero-copy): the copy list and its
        # count are read where they are, on the device. Not counted in ``stats`` (that would
        # need the count on the host); the slot cache counts its fills on the device.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for dst, src in pairs:
                copy_rows(dst, src, dst_idx, src_idx, count)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        return _CudaTransfer(ev)

    def _hold(self, transfer: Transfer, tensors: tuple[torch.Tensor, ...]) -> None:
        # The allocator is told the copy stream uses these blocks: when they are freed it
        # records an event on the copy stream and reuses them only once that has passed.
        # A reference kept in the transfer until ``wait`` would not do: a transfer dropped
        # unwaited (an error between issue and wait) would free them under the copy.
        for t in tensors:
            self._record_on_copy_stream(t)

    def _record_on_copy_stream(self, t: torch.Tensor) -> None:
        t.record_stream(self.copy_stream)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def to_host_async(self, dst: torch.Tensor, src: torch.Tensor) -> HostCopy:
        # from the compute stream (the data is produced there), into page-locked memory: the
        # copy is queued and an event marks it, which the reading thread waits on
        dst.copy_(src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return _EventCopy(ev)

    def device_fill_ok(self, src: torch.Tensor) -> bool:
        """Runs the zero-copy fill once on row 0 of ``src`` and compares it with a plain copy
        (a host pool that is not mapped for the device, or a Triton that refuses host
        pointers, fails here instead of mid-decode)."""
        try:
            one = torch.zeros(1, dtype=torch.int32, device=self.device)
            dst = torch.zeros((1, *src.shape[1:]), dtype=src.dtype, device=self.device)
            self.fill_rows([(dst, src)], one, one, one + 1).wait()
            torch.cuda.synchronize(self.device)
            ok = bool(torch.equal(dst[0].cpu(), src[0]))
        except Exception as e:  # noqa: BLE001 - any failure means: use the host-list copies
            log.warning("zero-copy expert fills unavailable (%s); copies go through the host", e)
            return False
        if not ok:
            log.warning("zero-copy expert fill gave wrong bytes; copies go through the host")
        return ok

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """Register ``t`` (portable | mapped: zero-copy fills read it in place) once; memory
        torch allocated pinned is mapped already. Undone by ``close`` or when ``t`` dies."""
        if t.numel() == 0 or (t.is_pinned() and not pinning.is_registered(t)):
            return t
        err = pinning.register(t)
        if err != 0:
            raise RuntimeError(f"cudaHostRegister failed ({err}); raise LimitMEMLOCK")
        self._pinned.append(weakref.ref(t))
        return t

    def close(self) -> None:
        """Unregister the host memory this accelerator pinned (model unload)."""
        for ref in self._pinned:
            t = ref()
            if t is not None:
                pinning.unregister(t)
        self._pinned.clear()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def mem_get_info(self) -> tuple[int, int] | None:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)
