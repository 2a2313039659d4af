"""GGUF block formats Q8_0 and Q4_K as raw bytes, in plain torch: quantise, dequantise, and the
reference of the native integer-dot kernels (native/dense/qdot.h).

A quantised matrix [R, C] is a uint8 tensor [R, row_bytes(fmt, C)]: each row is the GGUF blocks
of that row along C (the input dim), byte for byte as llama.cpp stores them, so a GGUF tensor's
raw data can be used unchanged and ours written to GGUF unchanged.

  q8_0  per 32 inputs, 34 bytes: fp16 d, int8 q[32];                       w = d * q
  q4_k  per 256 inputs, 144 bytes: fp16 d, fp16 dmin, 12 bytes of packed 6-bit scales sc[8] and
        mins m[8] (one pair per 32-input sub-block), 128 bytes of nibbles (input 64c + i is the
        low nibble of byte 32c + i, input 64c + 32 + i its high nibble);  w = d sc_j q - dmin m_j

The quantisers are simple round-to-nearest ones (amax for q8_0, per-sub-block min/max for
q4_k), not llama.cpp's search for the best scales; their output is valid GGUF all the same.

Activations are quantised per 32 inputs (``quantize_act``): fp32 scale amax / 127, int8 values
nearest-even of x * (127 / amax), and each block's sum of values (q4_k's mins use it). The native
kernels compute exact integer block dot products and combine them in fp32, as ``qdot_reference``.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

BLOCK_INPUTS = {"q8_0": 32, "q4_k": 256}
BLOCK_BYTES = {"q8_0": 34, "q4_k": 144}
QTYPE_CODES = {"q8_0": 0, "q4_k": 1}  # ftdense's qtype codes
ACT_BLOCK = 32


def row_bytes(fmt: str, cols: int) -> int:
    """Bytes of one quantised row of ``cols`` inputs (a multiple of the block)."""
    return cols // BLOCK_INPUTS[fmt] * BLOCK_BYTES[fmt]


def supports(fmt: str, cols: int) -> bool:
    """Whether a matrix with ``cols`` inputs can be stored as ``fmt``."""
    return cols > 0 and cols % BLOCK_INPUTS[fmt] == 0


def _fp16_bytes(x: Tensor) -> Tensor:
    """[...] fp32 -> [..., 2] uint8 (little-endian fp16)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _fp16_from(b: Tensor) -> Tensor:
    """[..., 2] uint8 -> [...] fp32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


# ---- q8_0 -------------------------------------------------------------------------------------


def quantize_q8_0(w: Tensor) -> Tensor:
    """[R, C] float -> [R, C/32 * 34] uint8."""
    r, c = w.shape
    blocks = w.float().reshape(r, c // 32, 32)
    d = (blocks.abs().amax(-1) / 127).to(torch.float16).float()
    q = torch.where(d[..., None] > 0, blocks / torch.where(d > 0, d, 1.0)[..., None], 0.0)
    q = q.round().clamp(-127, 127).to(torch.int8)
    out = torch.cat((_fp16_bytes(d), q.view(torch.uint8)), dim=-1)
    return out.reshape(r, c // 32 * 34)


def _split_q8_0(raw: Tensor) -> tuple[Tensor, Tensor]:
    """-> (d fp32 [R, nb], q int8 [R, nb, 32])."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    return _fp16_from(blocks[..., :2]), blocks[..., 2:].contiguous().view(torch.int8)


def dequantize_q8_0(raw: Tensor) -> Tensor:
    d, q = _split_q8_0(raw)
    return (d[..., None] * q.float()).reshape(raw.shape[0], -1)


# ---- q4_k -------------------------------------------------------------------------------------


def _pack_scales(sc: Tensor, m: Tensor) -> Tensor:
    """sc, m [..., 8] ints in [0, 63] -> [..., 12] uint8 (GGUF's K-quant 6-bit packing)."""
    sc, m = sc.long(), m.long()
    lo = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mid = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    hi = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return torch.cat((lo, mid, hi), dim=-1).to(torch.uint8)


def _unpack_scales(s: Tensor) -> tuple[Tensor, Tensor]:
    """[..., 12] uint8 -> (sc, m) [..., 8] int64."""
    s = s.long()
    sc = torch.cat((s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)), dim=-1)
    m = torch.cat((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), dim=-1)
    return sc, m


def quantize_q4_k(w: Tensor) -> Tensor:
    """[R, C] float (C a multiple of 256) -> [R, C/256 * 144] uint8."""
    r, c = w.shape
    nsb = c // 256
    sub = w.float().reshape(r, nsb, 8, 32)
    lo = sub.amin(-1).clamp(max=0.0)
    scale = (sub.amax(-1) - lo) / 15  # [r, nsb, 8]
    mins = -lo
    d = (scale.amax(-1) / 63).to(torch.float16).float()  # [r, nsb]
    dmin = (mins.amax(-1) / 63).to(torch.float16).float()
    sc = torch.where(d[..., None] > 0, scale / torch.where(d > 0, d, 1.0)[..., None], 0.0)
    sc = sc.round().clamp(0, 63)
    m = torch.where(dmin[..., None] > 0, mins / torch.where(dmin > 0, dmin, 1.0)[..., None], 0.0)
    m = m.round().clamp(0, 63)
    eff = (d[..., None] * sc)[..., None]  # [r, nsb, 8, 1]
    off = (dmin[..., None] * m)[..., None]
    q = torch.where(eff > 0, (sub + off) / torch.where(eff > 0, eff, 1.0), 0.0)
    q = q.round().clamp(0, 15).to(torch.uint8).reshape(r, nsb, 4, 2, 32)
    nib = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [r, nsb, 4, 32]
    out = torch.cat(
        (
            _fp16_bytes(d),
            _fp16_bytes(dmin),
            _pack_scales(sc, m),
            nib.reshape(r, nsb, 128),
        ),
        dim=-1,
    )
    return out.reshape(r, nsb * 144)


def _split_q4_k(raw: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> d, dmin [R, nsb] fp32; sc, m [R, nsb, 8] int64; q [R, nsb, 8, 32] int64 (0..15)."""
    blocks = raw.reshape(raw.shape[0], -1, 144)
    d, dmin = _fp16_from(blocks[..., 0:2]), _fp16_from(blocks[..., 2:4])
    sc, m = _unpack_scales(blocks[..., 4:16])
    nib = blocks[..., 16:].long().reshape(*blocks.shape[:2], 4, 1, 32)
    q = torch.cat((nib & 15, nib >> 4), dim=3).reshape(*blocks.shape[:2], 8, 32)
    return d, dmin, sc, m, q


def dequantize_q4_k(raw: Tensor) -> Tensor:
    d, dmin, sc, m, q = _split_q4_k(raw)
    w = (d[..., None] * sc)[..., None] * q.float() - (dmin[..., None] * m)[..., None]
    return w.reshape(raw.shape[0], -1)


QUANTIZE = {"q8_0": quantize_q8_0, "q4_k": quantize_q4_k}
DEQUANTIZE = {"q8_0": dequantize_q8_0, "q4_k": dequantize_q4_k}


def quantize(w: Tensor, fmt: str) -> Tensor:
    """[R, C] float -> raw GGUF rows of ``fmt``; ValueError when C does not fit the block."""
    if fmt not in QUANTIZE:
        raise ValueError(f"unknown block format {fmt!r} (one of {', '.join(QUANTIZE)})")
    if w.dim() != 2 or not supports(fmt, w.shape[1]):
        raise ValueError(f"{fmt} needs [R, C] with C a multiple of {BLOCK_INPUTS[fmt]}")
    return QUANTIZE[fmt](w)


def dequantize(raw: Tensor, fmt: str) -> Tensor:
    """Raw GGUF rows of ``fmt`` -> [R, C] fp32."""
    return DEQUANTIZE[fmt](raw)


# ---- activations and the integer-dot reference ------------------------------------------------


def quantize_act(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [T, K] -> (q [T, K] int8, d [T, K/32] fp32, s [T, K/32] int16): what ftdense computes,
    bit for bit."""
    t, k = x.shape
    b = x.float().reshape(t, k // ACT_BLOCK, ACT_BLOCK)
    amax = b.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    q = torch.round(b * inv[..., None])  # round half to even, as the kernels
    return (
        q.to(torch.int8).reshape(t, k),
        amax / 127,
        q.sum(-1).to(torch.int16),
    )


def qdot_reference(raw: Tensor, fmt: str, x: Tensor) -> Tensor:
    """y [T, N] = x @ W^T the way the native kernels compute it: activations quantised by
    ``quantize_act``, exact integer dot products per block, fp32 scales."""
    if x.shape[0] > 64:  # bounded memory: the integer products are [T, N, K] int64
        return torch.cat([qdot_reference(raw, fmt, c) for c in x.split(64)])
    xq, dx, sx = quantize_act(x)
    t = x.shape[0]
    if fmt == "q8_0":
        dw, wq = _split_q8_0(raw)  # [N, nb], [N, nb, 32]
        xb = xq.long().reshape(t, 1, -1, 32)
        isum = (wq.long()[None] * xb).sum(-1)  # [T, N, nb]
        return (dw[None] * dx[:, None] * isum.float()).sum(-1)
    if fmt == "q4_k":
        d, dmin, sc, m, q = _split_q4_k(raw)
        n, nsb = d.shape
        xb = xq.long().reshape(t, 1, nsb, 8, 32)
        isum = (q[None] * xb).sum(-1)  # [T, N, nsb, 8]
        dxb = dx.reshape(t, 1, nsb, 8)
        sxb = sx.long().reshape(t, 1, nsb, 8)
        term = dxb * (d[None, ..., None] * (sc[None] * isum).float()) - dxb * (
            dmin[None, ..., None] * (m[None] * sxb).float()
        )
        return term.reshape(t, n, -1).sum(-1)
    raise ValueError(f"unknown block format {fmt!r}")
