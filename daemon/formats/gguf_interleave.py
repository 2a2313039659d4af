"""Our interleaved layout of GGUF K-quant, MXFP4 and Q8_0 rows (native/dense/qdot.h's Q4_K_X8,
Q5_K_X8, Q6_K_X8, MXFP4_X8, Q8_0_X8): each whole group of 8 rows regrouped per super-block
(MXFP4, Q8_0: per block), so that the native kernels read one activation word for 8 rows. The
same bytes as the GGUF rows (gguf_blocks.py), rearranged; ``deinterleave`` gives the GGUF rows
back. The torch permutes here are the reference of the native byte moves
(ftdense.qinterleave) that run at load.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from .block_layout import (
    BLOCK_BYTES,
    BLOCK_INPUTS,
    INTERLEAVE_ROWS,
    INTERLEAVED_CODES,
    QTYPE_CODES,
)
from .block_layout import interleavable as interleavable

Tensor = torch.Tensor


def _groups(raw: Tensor, fmt: str) -> tuple[int, int]:
    """(groups of 8 rows, super-blocks per row) of ``fmt`` rows that have an interleaved layout."""
    if fmt not in INTERLEAVED_CODES:
        raise ValueError(f"no interleaved layout for {fmt!r}")
    rows, nbytes = raw.shape
    size = BLOCK_BYTES[fmt]
    if raw.dtype != torch.uint8 or rows % INTERLEAVE_ROWS or nbytes % size:
        raise ValueError(f"{fmt} rows are uint8 [8g, {size}s], got {raw.dtype} {list(raw.shape)}")
    return rows // INTERLEAVE_ROWS, nbytes // size


def _with_tail(raw: Tensor, fmt: str, fn: Callable[[Tensor, str], Tensor]) -> Tensor:
    """``fn`` over the rows in whole groups of 8; the last R % 8 rows stay plain GGUF rows."""
    if raw.dim() != 2 or raw.shape[0] < INTERLEAVE_ROWS:
        raise ValueError(f"{fmt} rows to interleave are [R >= 8, bytes], got {list(raw.shape)}")
    whole = raw.shape[0] // INTERLEAVE_ROWS * INTERLEAVE_ROWS
    if whole == raw.shape[0]:
        return fn(raw, fmt)
    return torch.cat([fn(raw[:whole], fmt), raw[whole:]])


def interleave(raw: Tensor, fmt: str, native: bool = True) -> Tensor:
    """GGUF rows [R, bytes] (R >= 8) -> the same bytes with each whole group of 8 rows
    interleaved as the native kernels of ``INTERLEAVED_CODES`` read them (native/dense/qdot.h):
    per super-block, the 8 rows' scales first (field by field, 32-bit words of the scale bytes)
    and then their values 4 bytes a row at a time; the last R % 8 rows stay as they are (the
    kernels compute them with the plain type's). ``deinterleave`` undoes it. With the extension
    built (and ``native``) its byte moves run (qinterleave: ~5x torch's permutes at load); the
    torch permutes are the reference."""
    if native and _native_moves(raw, fmt):
        return _native_move(raw, fmt, undo=False)
    return _with_tail(raw, fmt, _interleave)


def deinterleave(raw: Tensor, fmt: str, native: bool = True) -> Tensor:
    """``interleave``'s inverse: the GGUF rows."""
    if native and _native_moves(raw, fmt):
        return _native_move(raw, fmt, undo=True)
    return _with_tail(raw, fmt, _deinterleave)


def interleave_in_place(raw: Tensor, fmt: str, scratch: Tensor) -> bool:
    """``interleave`` of ``raw`` (contiguous) written back into ``raw`` itself: the rows copied
    once into ``scratch`` (contiguous uint8 of at least raw's bytes, reused across calls, so it
    stays in cache and is never faulted in again) and the native byte moves run from there into
    ``raw``: one pass over the destination where interleave-then-copy_ made a new tensor (page
    faults) and a second pass. False (``raw`` untouched) when the native moves cannot take it."""
    n = raw.numel()
    if not (_native_moves(raw, fmt) and raw.is_contiguous() and scratch.numel() >= n):
        return False
    assert scratch.dtype == torch.uint8 and scratch.is_contiguous()
    # deferred: ftdense (native extension)
    import ftdense

    ctypes.memmove(scratch.data_ptr(), raw.data_ptr(), n)  # one plain memcpy, no thread pool
    cols = raw.shape[1] // BLOCK_BYTES[fmt] * BLOCK_INPUTS[fmt]
    ftdense.qinterleave(
        QTYPE_CODES[fmt], scratch.data_ptr(), raw.data_ptr(), raw.shape[0], cols, False
    )
    return True


def native_moves_available() -> bool:
    """Whether the native byte moves (ftdense.qinterleave) are built."""
    try:
        # deferred: ftdense (native extension)
        import ftdense
    except ImportError:
        return False
    return hasattr(ftdense, "qinterleave")


def interleave_to(src: Tensor, dest: Tensor, fmt: str) -> None:
    """``interleave`` of the GGUF rows ``src`` written into ``dest`` (another contiguous uint8
    tensor of the same shape) by the native byte moves, with no temporary: a loader reads the
    rows into a reused buffer and interleaves them straight into their bank. ValueError when the
    native moves cannot take them."""
    if not (_native_moves(src, fmt) and src.is_contiguous() and dest.is_contiguous()):
        raise ValueError(f"the native moves cannot interleave {fmt} rows {list(src.shape)}")
    if dest.dtype != torch.uint8 or dest.shape != src.shape:
        raise ValueError(f"{fmt} rows {list(src.shape)} cannot go into {list(dest.shape)}")
    # deferred: ftdense (native extension)
    import ftdense

    cols = src.shape[1] // BLOCK_BYTES[fmt] * BLOCK_INPUTS[fmt]
    ftdense.qinterleave(
        QTYPE_CODES[fmt], src.data_ptr(), dest.data_ptr(), src.shape[0], cols, False
    )


def _native_moves(raw: Tensor, fmt: str) -> bool:
    """Whether the native byte moves (ftdense.qinterleave) can take ``raw``: the extension is
    built and it is a CPU uint8 matrix of at least 8 rows of ``fmt``."""
    try:
        # deferred: ftdense (native extension)
        import ftdense  # type: ignore[import-not-found]
    except ImportError:
        return False
    return (
        hasattr(ftdense, "qinterleave")
        and fmt in INTERLEAVED_CODES
        and raw.dtype == torch.uint8
        and raw.dim() == 2
        and raw.device.type == "cpu"
        and raw.shape[0] >= INTERLEAVE_ROWS
        and raw.shape[1] % BLOCK_BYTES[fmt] == 0
    )


def _native_move(raw: Tensor, fmt: str, undo: bool) -> Tensor:
    """``interleave`` (undo False) or ``deinterleave`` of ``raw`` by the native byte moves."""
    # deferred: ftdense (native extension)
    import ftdense

    src = raw.contiguous()
    out = torch.empty_like(src)
    cols = raw.shape[1] // BLOCK_BYTES[fmt] * BLOCK_INPUTS[fmt]
    ftdense.qinterleave(QTYPE_CODES[fmt], src.data_ptr(), out.data_ptr(), raw.shape[0], cols, undo)
    return out


def _interleave(raw: Tensor, fmt: str) -> Tensor:
    g, nsb = _groups(raw, fmt)
    x = raw.view(g, 8, nsb, BLOCK_BYTES[fmt]).permute(0, 2, 1, 3)  # [g, sb, row, bytes]
    parts: tuple[Tensor, ...]
    if fmt in ("q4_k", "q5_k"):  # q5_k: the qh words (8 of 4 bytes a row) before the nibbles
        qs = 48 if fmt == "q5_k" else 16
        five = (x[..., 16:48].reshape(g, nsb, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(g, nsb, 256),)
        parts = (
            x[..., 0:2].reshape(g, nsb, 16),
            x[..., 2:4].reshape(g, nsb, 16),
            x[..., 4:16].reshape(g, nsb, 8, 3, 4).permute(0, 1, 3, 2, 4).reshape(g, nsb, 96),
            *(five if fmt == "q5_k" else ()),
            x[..., qs:].reshape(g, nsb, 8, 4, 8, 4).permute(0, 1, 4, 3, 2, 5).reshape(g, nsb, 1024),
        )
    elif fmt == "mxfp4":  # per block: the 8 e8m0 bytes, then 4-byte words of the 8 rows' qs
        parts = (
            x[..., 0].reshape(g, nsb, 8),
            x[..., 1:].reshape(g, nsb, 8, 4, 4).permute(0, 1, 3, 2, 4).reshape(g, nsb, 128),
        )
    elif fmt == "q8_0":  # per block: the 8 fp16 d, then 4-byte words of the 8 rows' q
        parts = (
            x[..., 0:2].reshape(g, nsb, 16),
            x[..., 2:].reshape(g, nsb, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(g, nsb, 256),
        )
    else:  # q6_k: ql [128], qh [64], scales [16], d
        ql = x[..., 0:128].reshape(g, nsb, 8, 2, 2, 8, 4).permute(0, 1, 3, 5, 4, 2, 6)
        qh = x[..., 128:192].reshape(g, nsb, 8, 2, 8, 4).permute(0, 1, 3, 4, 2, 5).unsqueeze(4)
        parts = (
            x[..., 208:210].reshape(g, nsb, 16),
            x[..., 192:208].reshape(g, nsb, 8, 4, 4).permute(0, 1, 3, 2, 4).reshape(g, nsb, 128),
            torch.cat([ql, qh], dim=4).reshape(g, nsb, 1536),  # [h, i4, (ql0 ql1 qh), row, 4]
        )
    return torch.cat(parts, dim=-1).reshape(raw.shape)


def _deinterleave(raw: Tensor, fmt: str) -> Tensor:
    g, nsb = _groups(raw, fmt)
    y = raw.reshape(g, nsb, 8 * BLOCK_BYTES[fmt])
    parts: tuple[Tensor, ...]
    if fmt in ("q4_k", "q5_k"):
        qs = 384 if fmt == "q5_k" else 128
        five = (
            y[..., 128:384].reshape(g, nsb, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(g, nsb, 8, 32),
        )
        parts = (
            y[..., 0:16].reshape(g, nsb, 8, 2),
            y[..., 16:32].reshape(g, nsb, 8, 2),
            y[..., 32:128].reshape(g, nsb, 3, 8, 4).permute(0, 1, 3, 2, 4).reshape(g, nsb, 8, 12),
            *(five if fmt == "q5_k" else ()),
            y[..., qs:]
            .reshape(g, nsb, 8, 4, 8, 4)
            .permute(0, 1, 4, 3, 2, 5)
            .reshape(g, nsb, 8, 128),
        )
    elif fmt == "mxfp4":
        parts = (
            y[..., 0:8].reshape(g, nsb, 8, 1),
            y[..., 8:].reshape(g, nsb, 4, 8, 4).permute(0, 1, 3, 2, 4).reshape(g, nsb, 8, 16),
        )
    elif fmt == "q8_0":
        parts = (
            y[..., 0:16].reshape(g, nsb, 8, 2),
            y[..., 16:].reshape(g, nsb, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(g, nsb, 8, 32),
        )
    else:
        body = y[..., 144:].reshape(g, nsb, 2, 8, 3, 8, 4)
        parts = (
            body[..., 0:2, :, :].permute(0, 1, 5, 2, 4, 3, 6).reshape(g, nsb, 8, 128),
            body[..., 2, :, :].permute(0, 1, 4, 2, 3, 5).reshape(g, nsb, 8, 64),
            y[..., 16:144].reshape(g, nsb, 4, 8, 4).permute(0, 1, 3, 2, 4).reshape(g, nsb, 8, 16),
            y[..., 0:16].reshape(g, nsb, 8, 2),
        )
    return torch.cat(parts, dim=-1).permute(0, 2, 1, 3).reshape(raw.shape)
