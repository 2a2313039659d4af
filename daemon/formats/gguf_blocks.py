"""GGUF block formats as raw bytes, in plain torch: quantise, dequantise, and the reference of the
native integer-dot kernels (native/dense/qdot.h). The formats themselves (byte layouts,
quantisers, integer forms) are in gguf_blocks32.py (q8_0, q4_0, q5_0, mxfp4: blocks of 32
inputs) and gguf_kquants.py (q4_k, q5_k, q6_k: super-blocks of 256).

A quantised matrix [R, C] is a uint8 tensor [R, row_bytes(fmt, C)]: each row is the GGUF blocks
of that row along C (the input dim), byte for byte as llama.cpp stores them, so a GGUF tensor's
raw data can be used unchanged and ours written to GGUF unchanged.

Activations are quantised per group of inputs (``quantize_act``), as llama.cpp does: int8 values
nearest-even of x * (127 / amax) with one fp32 scale per group, 32 inputs for the 32-input
formats (scale amax / 127, llama.cpp's Q8_0) and 256 for the K-quants (scale 1 / (127 / amax),
its Q8_K), and each 32 inputs' sum of values (the K-quants' mins use it). llama.cpp also rounds
the Q8_0 scale to fp16, which ours do with ``qlinear_native.set_fp16_act_scales(True)``. The
native kernels compute exact integer block dot products against each format's integer weights
and combine them in fp32, as ``qdot_reference``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import gguf_blocks32 as b32
from . import gguf_kquants as kq

# the block types' sizes and codes (re-exported: gguf_blocks is where callers look for them)
from .block_layout import BLOCK_BYTES as BLOCK_BYTES
from .block_layout import BLOCK_INPUTS
from .block_layout import QTYPE_CODES as QTYPE_CODES
from .block_layout import row_bytes as row_bytes
from .gguf_blocks32 import IntForm

Tensor = torch.Tensor

ACT_BLOCK = 32

_QUANTIZE: dict[str, Callable[[Tensor], Tensor]] = {
    "q8_0": b32.quantize_q8_0,
    "q4_k": kq.quantize_q4_k,
    "q6_k": kq.quantize_q6_k,
    "q5_k": kq.quantize_q5_k,
    "mxfp4": b32.quantize_mxfp4,
    "q5_0": b32.quantize_q5_0,
    "q4_0": b32.quantize_q4_0,
}
_INT_FORM: dict[str, Callable[[Tensor], IntForm]] = {
    "q8_0": b32.int_form_q8_0,
    "q4_k": kq.int_form_q4_k,
    "q6_k": kq.int_form_q6_k,
    "q5_k": kq.int_form_q5_k,
    "mxfp4": b32.int_form_mxfp4,
    "q5_0": b32.int_form_q5_0,
    "q4_0": b32.int_form_q4_0,
}


def supports(fmt: str, cols: int) -> bool:
    """Whether a matrix with ``cols`` inputs can be stored as ``fmt``."""
    return cols > 0 and cols % BLOCK_INPUTS[fmt] == 0


def quantize(w: Tensor, fmt: str) -> Tensor:
    """[R, C] float -> raw GGUF rows of ``fmt``; ValueError when C does not fit the block."""
    if fmt not in _QUANTIZE:
        raise ValueError(f"unknown block format {fmt!r} (one of {', '.join(_QUANTIZE)})")
    if w.dim() != 2 or not supports(fmt, w.shape[1]):
        raise ValueError(f"{fmt} needs [R, C] with C a multiple of {BLOCK_INPUTS[fmt]}")
    return _QUANTIZE[fmt](w)


def int_form(raw: Tensor, fmt: str) -> IntForm:
    """Raw GGUF rows of ``fmt`` -> the integer form (gguf_blocks32.IntForm)."""
    if fmt not in _INT_FORM:
        raise ValueError(f"unknown block format {fmt!r} (one of {', '.join(_INT_FORM)})")
    return _INT_FORM[fmt](raw)


def dequantize(raw: Tensor, fmt: str) -> Tensor:
    """Raw GGUF rows of ``fmt`` -> [R, C] fp32."""
    f = int_form(raw, fmt)
    w = f.a[..., None] * f.wi.float()
    if f.b is not None:
        w = w + f.b[..., None]
    return w.reshape(raw.shape[0], -1)


# ---- activations and the integer-dot reference ------------------------------------------------


_FP16_ACT_SCALES = [False]  # set_fp16_act_scales (native/qlinear_native.py) keeps it in step


def act_group(fmt: str) -> int:
    """The activation group the kernels of weight format ``fmt`` read: 32 or 256 inputs."""
    return 256 if BLOCK_INPUTS[fmt] == 256 else ACT_BLOCK


def quantize_act(x: Tensor, group: int = ACT_BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """x [T, K] -> (q [T, K] int8, d [T, K/32] fp32, s [T, K/32] int16): what ftdense computes,
    bit for bit, in groups of ``group`` (32 or 256) inputs; d holds each 32 inputs' group scale."""
    t, k = x.shape
    b = x.float().reshape(t, k // group, group)
    amax = b.abs().amax(-1)
    # a tensor over a tensor: `127.0 / t` is t.reciprocal() * 127, rounded twice
    inv = torch.where(
        amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, 1.0), 0.0
    )
    q = torch.round(b * inv[..., None]).reshape(t, k // ACT_BLOCK, ACT_BLOCK)  # half to even
    if group == ACT_BLOCK:
        d = amax / 127
        if _FP16_ACT_SCALES[0]:  # llama.cpp's Q8_0 scale is fp16 (where fp16 holds it)
            d16 = d.to(torch.float16).float()
            d = torch.where(d16.isfinite(), d16, d)
    else:  # llama.cpp's Q8_K scale
        d = torch.where(amax > 0, torch.ones_like(inv) / torch.where(inv > 0, inv, 1.0), 0.0)
    return (
        q.to(torch.int8).reshape(t, k),
        d.repeat_interleave(group // ACT_BLOCK, -1),
        q.sum(-1).to(torch.int16),
    )


def qdot_reference(raw: Tensor, fmt: str, x: Tensor, group: int | None = None) -> Tensor:
    """y [T, N] = x @ W^T the way the native kernels compute it: activations quantised by
    ``quantize_act`` in the format's group (or ``group``), exact integer dot products per block
    of 32 (of the integer form's weights with the int8 activations), then
    sum_blocks d_x (a * dot + b * sum_x), here in fp64."""
    f = int_form(raw, fmt)
    xq, dx, sx = quantize_act(x, act_group(fmt) if group is None else group)
    t, nb = dx.shape
    # Integers below 2^53 are exact in fp64 whatever the summation order.
    dots = torch.einsum("nbi,tbi->tnb", f.wi.double(), xq.double().reshape(t, nb, ACT_BLOCK))
    per_block = f.a.double()[None] * dots
    if f.b is not None:
        per_block = per_block + f.b.double()[None] * sx.double()[:, None]
    return (dx.double()[:, None] * per_block).sum(-1).float()
