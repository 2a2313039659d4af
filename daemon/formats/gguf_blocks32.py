"""The GGUF block formats of 32 inputs (q8_0, q4_0, q5_0, mxfp4) as raw bytes, in plain torch, and
the pieces every format's code shares (fp16 bytes, the integer form). Entry points are in
formats/gguf_blocks.py; the byte layouts, as llama.cpp stores them:

  q8_0   34 bytes: fp16 d, int8 q[32];                                  w = d q
  q4_0   18 bytes: fp16 d, qs[16]; input i < 16 is the low nibble of qs[i], input 16 + i its
         high nibble;                                                    w = d (nib - 8)
  q5_0   22 bytes: fp16 d, qh (uint32 little-endian: bit i is input i's fifth bit), qs[16] as
         q4_0;                                                           w = d (nib | bit << 4 - 16)
  mxfp4  17 bytes: e8m0 exponent byte e, qs[16] as q4_0 holding e2m1 codes; the code's value
         doubled is one of (0 1 2 3 4 6 8 12, then the same negated) and the block scale is half
         of 2^(e - 127), so w = 2^(e - 128) * doubled value (exact in fp32 for every e)

Every format is also given in its integer form (``IntForm``): per block of 32 inputs an integer
weight per input, a float multiplier a and an offset b (K-quants' mins), w = a * wi + b. The
native kernels take exact integer dot products of wi with the int8 activations, so this form is
both the dequantisation and the reference of the kernels (gguf_blocks.qdot_reference).

The quantisers are plain round-to-nearest ones, not llama.cpp's searches for the best scales;
their output is valid GGUF all the same.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

Tensor = torch.Tensor


class IntForm(NamedTuple):
    """A quantised matrix [R, C] per block of 32 inputs: w = a * wi + b (b None: zero)."""

    wi: Tensor  # [R, C/32, 32] int32
    a: Tensor  # [R, C/32] fp32
    b: Tensor | None  # [R, C/32] fp32


def fp16_bytes(x: Tensor) -> Tensor:
    """[...] fp32 -> [..., 2] uint8 (little-endian fp16)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def fp16_from(b: Tensor) -> Tensor:
    """[..., 2] uint8 -> [...] fp32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def safe_div(x: Tensor, d: Tensor) -> Tensor:
    """x / d broadcast, 0 where d is 0 (an all-zero block quantises to zeros)."""
    return torch.where(d != 0, x / torch.where(d != 0, d, 1.0), 0.0)


def _blocks(raw: Tensor, nbytes: int) -> Tensor:
    return raw.reshape(raw.shape[0], -1, nbytes)


def _nibbles(qs: Tensor) -> Tensor:
    """[..., 16] uint8 -> [..., 32] int32: low nibbles (inputs 0-15), then high (16-31)."""
    q = qs.int()
    return torch.cat((q & 15, q >> 4), dim=-1)


def _pack_nibbles(q: Tensor) -> Tensor:
    """[..., 32] ints in [0, 15] -> [..., 16] uint8 (the inverse of ``_nibbles``)."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _signed_max(blocks: Tensor) -> Tensor:
    """Per block the value of largest magnitude, with its sign: [..., 32] -> [...]."""
    return blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)


# ---- q8_0 -------------------------------------------------------------------------------------


def quantize_q8_0(w: Tensor) -> Tensor:
    r, c = w.shape
    blocks = w.float().reshape(r, c // 32, 32)
    d = (blocks.abs().amax(-1) / 127).to(torch.float16).float()
    q = safe_div(blocks, d[..., None]).round().clamp(-127, 127).to(torch.int8)
    return torch.cat((fp16_bytes(d), q.view(torch.uint8)), dim=-1).reshape(r, c // 32 * 34)


def int_form_q8_0(raw: Tensor) -> IntForm:
    b = _blocks(raw, 34)
    return IntForm(b[..., 2:].contiguous().view(torch.int8).int(), fp16_from(b[..., :2]), None)


# ---- q4_0 / q5_0 ------------------------------------------------------------------------------


def quantize_q4_0(w: Tensor) -> Tensor:
    """The largest-magnitude value of each block maps to -8 (as llama.cpp's reference)."""
    r, c = w.shape
    blocks = w.float().reshape(r, c // 32, 32)
    d = (_signed_max(blocks) / -8).to(torch.float16).float()
    q = (safe_div(blocks, d[..., None]).round() + 8).clamp(0, 15)
    return torch.cat((fp16_bytes(d), _pack_nibbles(q)), dim=-1).reshape(r, c // 32 * 18)


def int_form_q4_0(raw: Tensor) -> IntForm:
    b = _blocks(raw, 18)
    return IntForm(_nibbles(b[..., 2:]) - 8, fp16_from(b[..., :2]), None)


_BIT = 1 << torch.arange(32, dtype=torch.int64)


def quantize_q5_0(w: Tensor) -> Tensor:
    r, c = w.shape
    blocks = w.float().reshape(r, c // 32, 32)
    d = (_signed_max(blocks) / -16).to(torch.float16).float()
    q = (safe_div(blocks, d[..., None]).round() + 16).clamp(0, 31).long()
    qh = ((q >> 4) * _BIT).sum(-1)  # [r, nb] bit i = input i's fifth bit
    qh_bytes = torch.stack([(qh >> (8 * i)) & 255 for i in range(4)], dim=-1).to(torch.uint8)
    out = torch.cat((fp16_bytes(d), qh_bytes, _pack_nibbles(q & 15)), dim=-1)
    return out.reshape(r, c // 32 * 22)


def int_form_q5_0(raw: Tensor) -> IntForm:
    b = _blocks(raw, 22)
    qh = b[..., 2:6].long() << torch.arange(0, 32, 8)  # the 4 bytes, little-endian
    qh = qh.sum(-1)
    high = ((qh[..., None] & _BIT) != 0).int() << 4  # [R, nb, 32]
    return IntForm((_nibbles(b[..., 6:]) | high) - 16, fp16_from(b[..., :2]), None)


# ---- mxfp4 ------------------------------------------------------------------------------------

MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])  # doubled


def e8m0_half(e: Tensor) -> Tensor:
    """uint8 exponents -> 2^(e - 128) fp32 (half the e8m0 scale; subnormal for e < 2)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.float() - 128)


def quantize_mxfp4(w: Tensor) -> Tensor:
    """The smallest power-of-two scale that holds the block's largest magnitude without clipping
    (12 * 2^(e-128) >= amax), then each input to the nearest representable value."""
    r, c = w.shape
    blocks = w.float().reshape(r, c // 32, 32)
    amax = blocks.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 12)) + 128, 0.0).clamp(0, 254)
    e = e.to(torch.uint8)
    grid = e8m0_half(e)[..., None, None] * MXFP4_VALUES.float()  # [r, nb, 1, 16]
    codes = (blocks[..., None] - grid).abs().argmin(-1)  # the first code of equal error: +0
    out = torch.cat((e[..., None], _pack_nibbles(codes)), dim=-1)
    return out.reshape(r, c // 32 * 17)


def int_form_mxfp4(raw: Tensor) -> IntForm:
    b = _blocks(raw, 17)
    wi = MXFP4_VALUES.int()[_nibbles(b[..., 1:]).long()]
    return IntForm(wi, e8m0_half(b[..., 0]), None)
