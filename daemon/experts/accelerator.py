"""Accelerator interface: device memory, an asynchronous host->device transfer path, and events.

Two implementations:
- ``CudaAccelerator``: a dedicated transfer stream; copies come from pinned host memory with
  ``non_blocking=True``; the compute stream waits on an event recorded after the copies. A copy
  list that lives on the device (``fill_rows``) runs as a Triton kernel reading the pinned,
  mapped host pool in place, so decode never waits for the host to learn what to copy.
- ``StandinAccelerator``: a CPU stand-in for CI. Its "device" tensors are separate CPU tensors
  and a single copy worker thread plays the transfer stream, so every mechanism built on this
  interface (slot fills, double-buffered prefill, the hybrid split) runs and is tested without a GPU.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

ACCELERATORS = ("auto", "standin", "cuda", "fake-cuda")

log = logging.getLogger(__name__)

# (device bank, host bank, device rows, host rows): dst[d] <- src[s] for the listed rows
RowCopies = list[tuple[torch.Tensor, torch.Tensor, list[int], list[int]]]
# (device bank, host bank) of each tensor of an expert format
BankPairs = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TransferStats:
    copies: int = 0
    bytes: int = 0
    # copies whose worker was still busy when the caller went on (observed overlap, stand-in only)
    overlapped: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Transfer(ABC):
    """A handle on copies in flight."""

    @abstractmethod
    def wait(self) -> None:
        """Make subsequent compute see the copied data."""


class Accelerator(ABC):
    name: str
    device: torch.device

    def __init__(self) -> None:
        self.stats = TransferStats()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, copy=True)

    @abstractmethod
    def copy_rows(self, pairs: RowCopies) -> Transfer:
        """Asynchronously copy rows: for each (dst, src, dst_rows, src_rows), dst[d] <- src[s].

        ``dst`` lives on the device, ``src`` in (pinned) host memory; rows are whole experts.
        """

    @abstractmethod
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
        ``kernel``: run the Triton copy kernel (always on CUDA; on the stand-in, tests).
        """

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

    def _count(self, pairs: RowCopies) -> None:
        n = sum(len(d) for _, _, d, _ in pairs)
        b = sum(src[0].numel() * src.element_size() * len(s) for _, src, _, s in pairs if len(s))
        with self.stats.lock:
            self.stats.copies += n
            self.stats.bytes += b


class _FutureTransfer(Transfer):
    def __init__(self, fut: Future[None], stats: TransferStats) -> None:
        self.fut = fut
        self.stats = stats

    def wait(self) -> None:
        if not self.fut.done():
            with self.stats.lock:
                self.stats.overlapped += 1
        self.fut.result()


def _do_copies(pairs: RowCopies) -> None:
    for dst, src, drows, srows in pairs:
        for d, s in zip(drows, srows, strict=True):
            dst[d].copy_(src[s])


def _do_fill(
    pairs: BankPairs,
    dst_idx: torch.Tensor,
    src_idx: torch.Tensor,
    count: torch.Tensor,
    kernel: bool,
    stats: TransferStats,
) -> None:
    from ftkernels import moe_decode as k  # torch reference and Triton kernel

    n = int(count.reshape(-1)[0])  # the stand-in's "device" is host memory: free to read
    copy = k.copy_rows if kernel else k.copy_rows_reference
    for dst, src in pairs:
        copy(dst, src, dst_idx, src_idx, count)
    with stats.lock:
        stats.copies += n * len(pairs)
        stats.bytes += n * sum(src[0].numel() * src.element_size() for _, src in pairs)


class StandinAccelerator(Accelerator):
    name = "standin"

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-standin-copy")

    def copy_rows(self, pairs: RowCopies) -> Transfer:
        self._count(pairs)
        return _FutureTransfer(self._worker.submit(_do_copies, pairs), self.stats)

    def fill_rows(
        self,
        pairs: BankPairs,
        dst_idx: torch.Tensor,
        src_idx: torch.Tensor,
        count: torch.Tensor,
        kernel: bool = False,
    ) -> Transfer:
        fut = self._worker.submit(_do_fill, pairs, dst_idx, src_idx, count, kernel, self.stats)
        return _FutureTransfer(fut, self.stats)


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


class CudaAccelerator(Accelerator):
    name = "cuda"

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise RuntimeError("accelerator 'cuda' requested but no CUDA device is available")
        self.device = torch.device("cuda", index)
        self.copy_stream = torch.cuda.Stream(self.device)

    def copy_rows(self, pairs: RowCopies) -> Transfer:
        self._count(pairs)
        # The destination slots may still be read by compute queued before this call.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for dst, src, drows, srows in pairs:
                # one copy per run of consecutive rows (a prefill layer is one run)
                for d, s, n in _runs(drows, srows):
                    # a view of pinned memory
                    dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        return _CudaTransfer(ev)

    def fill_rows(
        self,
        pairs: BankPairs,
        dst_idx: torch.Tensor,
        src_idx: torch.Tensor,
        count: torch.Tensor,
        kernel: bool = True,
    ) -> Transfer:
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
        if t.is_pinned() or t.numel() == 0:
            return t
        cudart = torch.cuda.cudart()
        # portable | mapped: the device may read it in place (zero-copy expert fills)
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 3)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed ({err}); raise LimitMEMLOCK")
        return t

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def mem_get_info(self) -> tuple[int, int] | None:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)


def create_accelerator(name: str, vram_mib: int | None = None) -> Accelerator:
    """``vram_mib``: the simulated card of ``fake-cuda`` (enter the returned accelerator as a
    context manager around everything that touches the device)."""
    if name not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; choose one of {', '.join(ACCELERATORS)}")
    if name == "fake-cuda":
        from .fakecuda import FakeCudaAccelerator

        if vram_mib is None:
            raise ValueError("accelerator 'fake-cuda' needs vram_mib (the simulated card)")
        return FakeCudaAccelerator(vram_mib)
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return CudaAccelerator()
    return StandinAccelerator()
