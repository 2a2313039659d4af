"""VRAM watcher (ARCHITECTURE §6.2): shrink the expert slot cache when other processes take VRAM, grow
it back when they release it.

Every ``poll_s`` seconds the watcher reads the GPU's free memory through NVML (nvidia-ml-py);
free memory counts every process on the device, so a game or a browser taking VRAM shows up.
Below ``low`` bytes free, it asks for enough fewer slots to get back to ``low``; above ``high``
free and below the cache's target size (what ftctl or the config asked for), it grows by what
fits while leaving ``high`` free, so a grow never triggers the next shrink. Resizes go through
the same queued, safe-point path as ``ftctl cache --moe``.

Free memory as NVML reports it counts the blocks torch's caching allocator keeps reserved but
holds no tensor in as used, though our next allocations take them first: after one long prefill
they would push free memory under ``low`` (shrink, ``empty_cache``, grow, and shrink again at the
next prefill). So those bytes count as free (``torch_unallocated``).

Without NVML (no NVIDIA driver, no GPU) the watcher logs why once and stays off.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import NamedTuple

log = logging.getLogger(__name__)


class VramReading(NamedTuple):
    free: int  # bytes
    total: int


class SlotSizes(NamedTuple):
    current: int  # slots now
    target: int  # slots asked for (the size to grow back to)
    slot_bytes: int  # device bytes of one slot (one expert, all banks)
    min_slots: int  # never shrink below this


Reader = Callable[[], VramReading]
# bytes our allocator has reserved on the device but holds no tensor in
Unallocated = Callable[[], int]


def torch_unallocated(device: int | None = None) -> Unallocated:
    """A reader of the bytes torch's caching allocator keeps reserved but unallocated on the
    CUDA ``device`` (default: the current one of the calling thread, fixed now: the watcher
    reads it from its own thread); always 0 without CUDA."""
    # deferred: torch (this module starts without it)
    import torch

    if not torch.cuda.is_available():
        return lambda: 0
    index = torch.cuda.current_device() if device is None else device

    def read() -> int:
        cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return max(0, int(cached))

    return read


def nvml_reader(device_uuid: str | None = None) -> tuple[Reader | None, str]:
    """An NVML free-memory reader for the device (by UUID, else index 0), or None and why."""
    try:
        # deferred: pynvml (optional NVML bindings)
        import pynvml

        pynvml.nvmlInit()
        if device_uuid:
            handle = pynvml.nvmlDeviceGetHandleByUUID(device_uuid)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError, ...
        return None, f"off: NVML unavailable ({e})"

    def read() -> VramReading:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return VramReading(int(info.free), int(info.total))

    return read, "on"


def plan_resize(free: int, sizes: SlotSizes, low: int, high: int) -> int | None:
    """The new slot count for ``free`` bytes of free VRAM, or None to leave the cache alone."""
    cur, target, slot, floor = sizes
    if free < low and cur > floor:
        need = -(-(low - free) // slot)
        return max(floor, cur - need)
    if free > high and cur < target:
        room = (free - high) // slot
        if room >= 1:
            return min(target, cur + room)
    return None


class VramWatcher:
    def __init__(
        self,
        read: Reader,
        sizes: Callable[[], SlotSizes | None],
        resize: Callable[[int], None],
        low_bytes: int,
        high_bytes: int,
        poll_s: float = 2.0,
        unallocated: Unallocated | None = None,
    ) -> None:
        """``sizes`` describes the active model's slot cache (None: it has none); ``resize``
        applies a new slot count and returns once it is applied. ``unallocated``: the bytes our
        allocator holds reserved without a tensor in them, counted as free (default:
        ``torch_unallocated()`` of the current CUDA device)."""
        self.read, self.sizes, self.resize = read, sizes, resize
        self.unallocated = unallocated or torch_unallocated()
        self.low, self.high, self.poll_s = low_bytes, high_bytes, poll_s
        self.resizes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_once(self) -> int | None:
        """One reading and, if needed, one resize; returns the slot count applied."""
        sizes = self.sizes()
        if sizes is None:
            return None
        reading = self.read()
        cached = self.unallocated()
        new = plan_resize(reading.free + cached, sizes, self.low, self.high)
        if new is None or new == sizes.current:
            return None
        log.info(
            "VRAM watcher: %d MiB free (+%d MiB cached by us) of %d MiB; expert slots %d -> %d",
            reading.free >> 20, cached >> 20, reading.total >> 20, sizes.current, new,
        )  # fmt: skip
        self.resize(new)
        self.resizes += 1
        return new

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vram-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check_once()
            except Exception:  # a failed reading or resize must not end the watcher
                log.exception("VRAM watcher: check failed")
