"""Weights the CPU streams every token, backed by 2 MiB transparent huge pages.

A decode step on the CPU reads every weight it uses once, from DRAM: with 4 KiB pages that is a
TLB miss (a page walk) every 4 KiB of each weight stream. Most distributions set THP to
``madvise``, so anonymous memory (where our loaders put weights) gets huge pages only when asked;
llama.cpp's mmap of a GGUF file gets large page-cache folios from ext4 and xfs on recent kernels
anyway. After load, each weight tensor's whole 2 MiB regions are marked MADV_HUGEPAGE and
collapsed in place (MADV_COLLAPSE, Linux 6.1+; synchronous, about 0.5 s a GB here). Measured
on the decode benchmark's Q4_K_M file (2 threads, Sapphire Rapids VM): 17.5 -> 15.5 ms a token.
Where the kernel refuses (older kernels, THP off, no free huge pages), the weights stay as they
are: MADV_HUGEPAGE alone still lets khugepaged collapse them later. RSS does not grow: only
regions a tensor fills are collapsed.

Collapsing copies every weight a second time (0.5-1.5 s a GB on a 2-core VM). A load that knows
it will want huge pages (``advise_at_fill``) marks each weight tensor MADV_HUGEPAGE right after
allocating it, before a byte is written (``advise_new``): the page faults of the fill then get
2 MiB pages directly (THP ``defrag`` at its ``madvise`` default compacts for them), and
``back_with_huge_pages`` skips those tensors. Measured on the start-up benchmark's 1 GB of
experts (2-core EPYC VM): fill + collapse 1.4-2.9 s, advised fill 1.0-2.4 s, a plain fill
0.7-1.1 s.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar

import torch

from ..experts.banks import ExpertBanks

log = logging.getLogger(__name__)

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
MIN_BYTES = 4 << 20  # smaller tensors span at most one whole huge page: not worth a call


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


_ADVISING: ContextVar[bool] = ContextVar("advise_at_fill", default=False)
# (address, bytes) of the tensors advised before their fill: back_with_huge_pages skips them
_advised: set[tuple[int, int]] = set()


@contextlib.contextmanager
def advise_at_fill(enabled: bool = True) -> Iterator[None]:
    """Within: ``advise_new`` marks the weight tensors the loaders allocate MADV_HUGEPAGE before
    they are filled (a load whose weights are to be backed by huge pages)."""
    token = _ADVISING.set(enabled)
    _advised.clear()  # entries of an earlier load never backed: stale addresses
    try:
        yield
    finally:
        _ADVISING.reset(token)


def _whole_pages(t: torch.Tensor) -> tuple[int, int]:
    n = t.numel() * t.element_size()
    start = -(-t.data_ptr() // _HUGE) * _HUGE
    return start, (t.data_ptr() + n) // _HUGE * _HUGE


def advise_new(t: torch.Tensor) -> torch.Tensor:
    """Marks a just-allocated (never written) CPU tensor's whole 2 MiB regions MADV_HUGEPAGE
    inside ``advise_at_fill``, so that its fill faults in huge pages; returns ``t``."""
    if not _ADVISING.get() or t.device.type != "cpu":
        return t
    n = t.numel() * t.element_size()
    madvise = _madvise() if n >= MIN_BYTES else None
    start, end = _whole_pages(t)
    if madvise is not None and end > start and madvise(start, end - start, _MADV_HUGEPAGE) == 0:
        _advised.add((t.data_ptr(), n))
    return t


def back_with_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Collapses the whole 2 MiB regions of each CPU tensor of at least ``MIN_BYTES`` (each
    storage once) into huge pages, except those ``advise_new`` marked before their fill (their
    fill faulted huge pages in; khugepaged collapses what it could not); returns the bytes
    collapsed (0 where unsupported)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    t0, done, refused, seen = time.perf_counter(), 0, 0, set()
    for t in tensors:
        n = t.numel() * t.element_size()
        if t.device.type != "cpu" or n < MIN_BYTES or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if (t.data_ptr(), n) in _advised:
            _advised.discard((t.data_ptr(), n))
            continue
        start, end = _whole_pages(t)
        if end <= start:
            continue
        madvise(start, end - start, _MADV_HUGEPAGE)
        if madvise(start, end - start, _MADV_COLLAPSE) == 0:
            done += end - start
        else:
            refused += end - start
    if done or refused:
        log.info(
            "huge pages: %d MiB of weights collapsed in %.1f s%s",
            done >> 20,
            time.perf_counter() - t0,
            f" ({refused >> 20} MiB refused: left to khugepaged)" if refused else "",
        )
    return done


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
