"""Weights the CPU streams every token, backed by 2 MiB transparent huge pages.

A decode step on the CPU reads every weight it uses once, from DRAM: with 4 KiB pages that is a
TLB miss (a page walk) every 4 KiB of each weight stream. Most distributions set THP to
``madvise``, so anonymous memory (where our loaders put weights) gets huge pages only when asked;
llama.cpp's mmap of a GGUF file gets large page-cache folios from ext4 and xfs on recent kernels
anyway. Each weight tensor's whole 2 MiB regions are marked MADV_HUGEPAGE and collapsed in place
(MADV_COLLAPSE, Linux 6.1+). Measured on the decode benchmark's Q4_K_M file (2 threads, Sapphire
Rapids VM): 17.5 -> 15.5 ms a token; on the server benchmark's 1.65 GB Q4_K_M file (AMD EPYC
Zen 3 VM, 1 thread, CPU time a token over 48 tokens, a shared machine: noisy) 21.6 and 26.1 ms
with huge pages against 25.3, 27.8 and 28.4 ms without. Where the kernel refuses (older
kernels, THP off, no free huge pages), the weights stay as they are: MADV_HUGEPAGE alone still
lets khugepaged collapse them later. RSS does not grow: only regions a tensor fills are
collapsed.

The collapse runs on a thread of its own once the weights are filled (``collapse_in_background``),
beside the rest of the start-up and the first requests, never before the daemon is ready.
Backing the weights with huge pages while they are filled (MADV_HUGEPAGE before the first write,
so the fill's page faults take 2 MiB pages) was measured on that file at 1.3-1.8 s more kernel
CPU than a plain fill (clearing fresh 2 MiB pages: 29 % of the load's samples against 3 %), on
the path to ready; the background collapse copies the same bytes off that path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import torch

from ..experts.banks import ExpertBanks

log = logging.getLogger(__name__)

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PAGE = 4096
MIN_BYTES = 4 << 20  # smaller tensors span at most one whole huge page: not worth a call


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def prefault(t: torch.Tensor) -> bool:
    """Backs the whole 4 KiB pages of a CPU tensor about to be written with memory in one call
    (MADV_POPULATE_WRITE) instead of a page fault every 4 KiB as the writes reach them: the
    same pages, zeroed as a fault zeroes them, without the fault's entry and exit (measured on
    1 GiB, AMD EPYC Zen 3 VM: 0.68-0.96 s of CPU against 0.92-1.06 s to fault it in while
    copying). Whether the kernel did it (False: older kernels, not Linux; the writes fault as
    before)."""
    madvise = _madvise() if t.device.type == "cpu" else None
    if madvise is None:
        return False
    p = t.data_ptr()
    start, end = -(-p // _PAGE) * _PAGE, (p + t.numel() * t.element_size()) // _PAGE * _PAGE
    return end > start and madvise(start, end - start, _MADV_POPULATE_WRITE) == 0


def _whole_pages(t: torch.Tensor) -> tuple[int, int]:
    n = t.numel() * t.element_size()
    start = -(-t.data_ptr() // _HUGE) * _HUGE
    return start, (t.data_ptr() + n) // _HUGE * _HUGE


def _collapse(madvise: ctypes._CFuncPtr, t: torch.Tensor) -> tuple[int, int]:  # type: ignore[name-defined]
    """(bytes collapsed, bytes refused) of ``t``'s whole 2 MiB regions."""
    start, end = _whole_pages(t)
    if end <= start:
        return 0, 0
    madvise(start, end - start, _MADV_HUGEPAGE)
    if madvise(start, end - start, _MADV_COLLAPSE) == 0:
        return end - start, 0
    return 0, end - start


def _large(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The CPU tensors of at least ``MIN_BYTES``, each storage once."""
    out, seen = [], set()
    for t in tensors:
        n = t.numel() * t.element_size()
        if t.device.type != "cpu" or n < MIN_BYTES or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out.append(t)
    return out


def _log(done: int, refused: int, seconds: float) -> None:
    if done or refused:
        log.info(
            "huge pages: %d MiB of weights collapsed in %.1f s%s",
            done >> 20,
            seconds,
            f" ({refused >> 20} MiB refused: left to khugepaged)" if refused else "",
        )


def back_with_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Collapses the whole 2 MiB regions of each CPU tensor of at least ``MIN_BYTES`` (each
    storage once) into huge pages, now; returns the bytes collapsed (0 where unsupported)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    t0, done, refused = time.perf_counter(), 0, 0
    for t in _large(tensors):
        d, r = _collapse(madvise, t)
        done, refused = done + d, refused + r
    _log(done, refused, time.perf_counter() - t0)
    return done


def collapse_in_background(
    tensors: Iterable[torch.Tensor], first: Callable[[], object] | None = None
) -> threading.Thread | None:
    """``back_with_huge_pages`` on a thread of its own (the madvise calls release the GIL),
    one tensor after another; returns the thread, None where unsupported. The thread holds
    weak references only: a tensor freed before its turn (a model closed or swapped) is
    skipped, and the one being collapsed stays alive until its call returns. ``first``: called
    on the thread before any collapse (waits for a fill still writing the tensors; an error it
    raises ends the thread, collapsing nothing: the engine reports it)."""
    madvise = _madvise()
    if madvise is None:
        return None
    refs = [weakref.ref(t) for t in _large(tensors)]
    if not refs:
        return None

    def run() -> None:
        _lowest_priority()
        if first is not None:
            try:
                first()
            except Exception:  # noqa: BLE001  (the fill's error is the engine's to report)
                return
        t0, done, refused = time.perf_counter(), 0, 0
        for ref in refs:
            t = ref()
            if t is None:
                continue
            d, r = _collapse(madvise, t)
            done, refused = done + d, refused + r
            del t
        _log(done, refused, time.perf_counter() - t0)

    thread = threading.Thread(target=run, name="ft-hugepages", daemon=True)
    thread.start()
    return thread


# The collapse thread's nice value: its copies (in the kernel, on its own time) yield the cores
# to the engine's threads; an idle daemon collapses as fast as before. A 5.4 GB bf16 pool on an
# AMD EPYC Zen 4 VM (2 threads), 2048-token prefills right after the load, nice 0 against 19
# alternated: 7.46 / 6.83 / 4.92 / 4.21 / 4.20 s and 7.44 / 6.84 / 4.93 / 4.95 / 4.78 (collapse
# done by the third) against 5.27 / 5.11 / 5.22 / 5.15 / 4.85 and 6.93 / 5.55 / 5.56 / 4.96 /
# 5.52 (still collapsing after the fifth): the first prompts wait less, the sum is about even.
COLLAPSE_NICE = 19


def _lowest_priority() -> None:
    """This thread (only) to ``COLLAPSE_NICE``; nothing where the platform has no per-thread
    priority (Linux's setpriority takes a thread id)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COLLAPSE_NICE)
        except OSError:
            pass


def weight_tensors(model: torch.nn.Module, banks: ExpertBanks) -> Iterable[torch.Tensor]:
    """Every weight of ``model`` (parameters, GGUF block rows of quantized projections) and of
    the expert banks (every bank, per-layer and scale banks included)."""
    for m in model.modules():
        qw = getattr(m, "qweight", None)
        if qw is not None:
            yield qw.raw
        yield from m.parameters(recurse=False)
    yield from banks.all_tensors().values()
    yield from (b for b in (banks.gate_up_bias, banks.down_bias) if b is not None)
