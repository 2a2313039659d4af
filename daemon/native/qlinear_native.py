"""Native CPU projections with GGUF block-quantised weights (q8_0, q4_k, q6_k, q5_k, mxfp4, q5_0,
q4_0; extension `ftdense`, native/dense/qlinear.h and qdot.h).

    y = x @ W^T,  W given as raw GGUF rows (formats/gguf_blocks.py), x [T, K] fp32

The input rows are quantised to int8 per 32 inputs ONCE per call and shared by every weight of the
call (``qlinear_many``: q/k/v, gate/up); the weights never widen to floats: the kernels take exact
integer dot products per block (vpdpbusd on AVX512-VNNI, maddubs on AVX2, plain C++ otherwise)
and apply the block scales in fp32. The reference is ``qlinear_reference`` (plain torch, same
activation quantisation); the dequantised oracle is ``x @ weight.dequantize().T``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..formats import gguf_blocks, gguf_interleave
from . import dense_native

Tensor = torch.Tensor


@dataclass(frozen=True)
class QuantWeight:
    """One quantised matrix [rows, cols]: ``raw`` [rows, row_bytes(fmt, cols)] uint8.

    ``interleaved``: ``raw`` holds the rows interleaved by 8 (``gguf_interleave.interleave``), the
    layout the native kernels read fastest (one activation load serves 8 rows); the
    constructors choose it for the formats that have it when the kernels are built, and
    ``gguf_raw()`` gives the GGUF rows back (dequantisation, the reference, FTW files).

    ``in_perm`` (int64 [cols], or None): the raw rows' inputs in another order than the model's,
    input j of the blocks being the model's input ``in_perm[j]`` (a GGUF converter that moved
    whole input columns, such as Qwen3.5's tiled value heads of ``ssm_out``: blocks cannot move
    columns back, so the input moves instead). ``dequantize`` returns the model's order."""

    raw: Tensor
    fmt: str
    rows: int
    cols: int
    in_perm: Tensor | None = None
    interleaved: bool = False

    @classmethod
    def from_float(cls, w: Tensor, fmt: str) -> QuantWeight:
        """Quantise [rows, cols] (ValueError when cols does not fit the format's block)."""
        return cls(gguf_blocks.quantize(w, fmt), fmt, w.shape[0], w.shape[1]).for_kernels()

    @classmethod
    def from_raw(cls, raw: Tensor, fmt: str, cols: int) -> QuantWeight:
        """Wrap GGUF rows as read from a file (e.g. a tensor's raw blocks), checked."""
        if fmt not in gguf_blocks.BLOCK_BYTES or not gguf_blocks.supports(fmt, cols):
            raise ValueError(f"{fmt!r} cannot hold rows of {cols} inputs")
        want = gguf_blocks.row_bytes(fmt, cols)
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != want:
            raise ValueError(f"{fmt} rows of {cols} inputs are uint8 [R, {want}]")
        return cls(raw.contiguous(), fmt, raw.shape[0], cols).for_kernels()

    def for_kernels(self) -> QuantWeight:
        """This matrix in the layout the native kernels read fastest: rows interleaved by 8
        where the format has such a layout, the kernels are built and the rows are on the CPU."""
        if (
            self.interleaved
            or not gguf_interleave.interleavable(self.fmt, self.rows)
            or self.raw.device.type != "cpu"
            or not available()
        ):
            return self
        raw = gguf_interleave.interleave(self.raw, self.fmt)
        return dataclasses.replace(self, raw=raw, interleaved=True)

    def gguf_raw(self) -> Tensor:
        """The rows in GGUF's layout (``raw`` itself unless interleaved)."""
        return gguf_interleave.deinterleave(self.raw, self.fmt) if self.interleaved else self.raw

    @property
    def code(self) -> int:
        """The native kernels' qtype code of ``raw``'s layout."""
        codes = gguf_interleave.INTERLEAVED_CODES if self.interleaved else gguf_blocks.QTYPE_CODES
        return codes[self.fmt]

    def dequantize(self, device: torch.device | None = None) -> Tensor:
        """[rows, cols] fp32 in the model's input order, made on ``device`` (default: the
        blocks'; the packed rows cross, not the float matrix)."""
        raw = self.raw.to(device) if device else self.raw
        if self.interleaved:
            raw = gguf_interleave.deinterleave(raw, self.fmt)
        w = gguf_blocks.dequantize(raw, self.fmt)
        if self.in_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.in_perm.to(w.device)] = w
        return out

    def permuted_input(self, x: Tensor) -> Tensor:
        """x [T, cols] in the blocks' input order."""
        return x if self.in_perm is None else x[:, self.in_perm.to(x.device)]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


def available() -> bool:
    """True when `ftdense` (with its qdot kernels) is importable."""
    return dense_native.available() and hasattr(dense_native._native, "qlinear")


def isas() -> list[str]:
    """Integer-dot ISA paths this CPU runs, best first ("vnni", "avx2", "scalar")."""
    return list(dense_native._native.qdot_isas()) if available() else []


def configured_isa() -> str:
    """The path ``qlinear`` runs by default: the best of ``isas()`` for dense_native's "auto" and
    "avx512", "avx2" for "avx2", "scalar" for "scalar" and "emu512"; "" before configure()."""
    return str(dense_native._native.qdot_isa()) if available() else ""


def _ensure_configured() -> None:
    dense_native.ensure_configured()


def set_fp16_act_scales(on: bool) -> None:
    """Round the 32-input activation scales to fp16 as llama.cpp's Q8_0 does (process-wide, the
    kernels and ``gguf_blocks.quantize_act`` alike; off by default): for bit comparisons with
    llama.cpp on the same file (tests/test_gguf_llamacpp_slow.py)."""
    dense_native._native.set_fp16_act_scales(on)
    gguf_blocks._FP16_ACT_SCALES[0] = on


def quantize_act(x: Tensor, isa: str = "", group: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """The native activation quantisation (for tests): see ``gguf_blocks.quantize_act``."""
    _ensure_configured()
    t, k = x.shape
    xf = x.float().contiguous()
    q = torch.empty(t, k, dtype=torch.int8)
    d = torch.empty(t, k // gguf_blocks.ACT_BLOCK, dtype=torch.float32)
    s = torch.empty(t, k // gguf_blocks.ACT_BLOCK, dtype=torch.int16)
    dense_native._native.quantize_act(
        xf.data_ptr(), t, k, q.data_ptr(), d.data_ptr(), s.data_ptr(), isa, group
    )
    return q, d, s


def qlinear_many(
    x: Tensor,
    weights: Sequence[QuantWeight],
    biases: Sequence[Tensor | None] = (),
    isa: str = "",
) -> list[Tensor]:
    """x [T, K] -> [x @ w^T (+ b)] each [T, rows_w] fp32, in one call (x quantised once).
    ``isa`` "" runs the configured path; "vnni", "avx2" or "scalar" pick one (tests)."""
    if x.dim() != 2:
        raise ValueError("x must be [T, K]")
    t, k = x.shape
    for w in weights:
        if w.cols != k:
            raise ValueError(f"x has {k} features but a weight expects {w.cols}")
    if any(w.in_perm is not None for w in weights) and len(weights) > 1:  # its own input order
        bs = list(biases) + [None] * (len(weights) - len(biases))
        return [qlinear_many(x, (w,), (b,), isa)[0] for w, b in zip(weights, bs, strict=True)]
    if weights and weights[0].in_perm is not None:
        x = weights[0].permuted_input(x)
    _ensure_configured()
    xf = x.float().contiguous()
    ys = [torch.empty(t, w.rows, dtype=torch.float32) for w in weights]
    dense_native._native.qlinear(
        xf.data_ptr(),
        t,
        k,
        [w.raw.data_ptr() for w in weights],
        [w.rows for w in weights],
        [w.code for w in weights],
        [y.data_ptr() for y in ys],
        isa,
    )
    for y, b in zip(ys, biases, strict=False):
        if b is not None:
            y += b.float()
    return ys


def qlinear(x: Tensor, w: QuantWeight, bias: Tensor | None = None, isa: str = "") -> Tensor:
    """x [T, K] -> [T, rows] fp32 (see ``qlinear_many``)."""
    return qlinear_many(x, (w,), (bias,), isa)[0]


def qlinear_reference(x: Tensor, w: QuantWeight, bias: Tensor | None = None) -> Tensor:
    """What ``qlinear`` computes, in plain torch (same activation quantisation)."""
    y = gguf_blocks.qdot_reference(w.gguf_raw(), w.fmt, w.permuted_input(x))
    return y + bias.float() if bias is not None else y
