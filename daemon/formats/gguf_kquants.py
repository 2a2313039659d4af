"""The GGUF K-quant formats (super-blocks of 256 inputs) q4_k, q5_k and q6_k as raw bytes, in plain
torch: round-to-nearest quantisers and the integer form (formats/gguf_blocks32.IntForm) that is
their dequantisation and the native kernels' reference. Layouts, as llama.cpp stores them:

  q4_k  144 bytes: fp16 d, fp16 dmin, scales[12] (6-bit scale sc_j and min m_j of the 8
        sub-blocks of 32: j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: sc = (s[j+4] & 15) |
        (s[j-4] >> 6) << 4, m = (s[j+4] >> 4) | (s[j] >> 6) << 4), qs[128]: input 64c + i
        (i < 32) is the low nibble of qs[32c + i], input 64c + 32 + i its high nibble;
                                                          w = d sc_j q - dmin m_j, q in [0, 15]
  q5_k  176 bytes: fp16 d, fp16 dmin, scales[12] as q4_k, qh[32], qs[128] as q4_k; input 32j + i
        adds bit j of qh[i] as its fifth bit;            w = d sc_j q - dmin m_j, q in [0, 31]
  q6_k  210 bytes: ql[128], qh[64], int8 scales[16] (one per 16 inputs), fp16 d; in each half
        h of 128 inputs, input 128h + 32k + i (k < 4, i < 32) takes its low 4 bits from
        ql[64h + 32(k & 1) + i] (the low nibble for k < 2, the high one for k >= 2) and its top
        2 bits from bits 2k, 2k+1 of qh[32h + i];        w = d sc_(input / 16) (q - 32)

In the integer form the scales are folded into the integers (wi = sc_j q, and sc_g (q - 32) for
q6_k, per block of 32 inputs), the multiplier is d and the offset -dmin m_j.
"""

from __future__ import annotations

import torch

from .gguf_blocks32 import IntForm, fp16_bytes, fp16_from, safe_div

Tensor = torch.Tensor


def _pack_scales(sc: Tensor, m: Tensor) -> Tensor:
    """sc, m [..., 8] ints in [0, 63] -> [..., 12] uint8 (GGUF's K-quant 6-bit packing)."""
    sc, m = sc.long(), m.long()
    lo = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mid = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    hi = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return torch.cat((lo, mid, hi), dim=-1).to(torch.uint8)


def _unpack_scales(s: Tensor) -> tuple[Tensor, Tensor]:
    """[..., 12] uint8 -> (sc, m) [..., 8] int32."""
    s = s.int()
    sc = torch.cat((s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)), dim=-1)
    m = torch.cat((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), dim=-1)
    return sc, m


def _quantize_scale_min(w: Tensor, levels: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Asymmetric sub-blocks of 32 for q4_k/q5_k: -> d, dmin [r, nsb] (fp16-exact fp32), sc, m
    [r, nsb, 8] in [0, 63], q [r, nsb, 8, 32] in [0, levels]."""
    r, c = w.shape
    sub = w.float().reshape(r, c // 256, 8, 32)
    lo = sub.amin(-1).clamp(max=0.0)
    scale = (sub.amax(-1) - lo) / levels
    d = (scale.amax(-1) / 63).to(torch.float16).float()
    dmin = (-lo.amin(-1) / 63).to(torch.float16).float()
    sc = safe_div(scale, d[..., None]).round().clamp(0, 63)
    m = safe_div(-lo, dmin[..., None]).round().clamp(0, 63)
    eff = (d[..., None] * sc)[..., None]
    q = safe_div(sub + (dmin[..., None] * m)[..., None], eff).round().clamp(0, levels)
    return d, dmin, sc, m, q.to(torch.uint8)


def _low_nibbles(q: Tensor) -> Tensor:
    """q [r, nsb, 8, 32] -> [r, nsb, 128] uint8: sub-blocks 2c and 2c+1 share bytes 32c..."""
    q = (q & 15).reshape(*q.shape[:2], 4, 2, 32)
    return (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(*q.shape[:2], 128)


def quantize_q4_k(w: Tensor) -> Tensor:
    r, c = w.shape
    d, dmin, sc, m, q = _quantize_scale_min(w, 15)
    parts = (fp16_bytes(d), fp16_bytes(dmin), _pack_scales(sc, m), _low_nibbles(q))
    return torch.cat(parts, dim=-1).reshape(r, c // 256 * 144)


def quantize_q5_k(w: Tensor) -> Tensor:
    r, c = w.shape
    d, dmin, sc, m, q = _quantize_scale_min(w, 31)
    bits = (q >> 4).long() << torch.arange(8).reshape(8, 1)  # sub-block j -> bit j
    qh = bits.sum(2).to(torch.uint8)  # [r, nsb, 32]
    parts = (fp16_bytes(d), fp16_bytes(dmin), _pack_scales(sc, m), qh, _low_nibbles(q))
    return torch.cat(parts, dim=-1).reshape(r, c // 256 * 176)


def _int_form_scale_min(raw: Tensor, nbytes: int, five: bool) -> IntForm:
    b = raw.reshape(raw.shape[0], -1, nbytes)
    r, nsb = b.shape[:2]
    d, dmin = fp16_from(b[..., 0:2]), fp16_from(b[..., 2:4])
    sc, m = _unpack_scales(b[..., 4:16])
    nib = b[..., nbytes - 128 :].int().reshape(r, nsb, 4, 1, 32)
    q = torch.cat((nib & 15, nib >> 4), dim=3).reshape(r, nsb, 8, 32)
    if five:
        qh = b[..., 16:48].int().reshape(r, nsb, 1, 32)
        q = q | (((qh >> torch.arange(8, dtype=torch.int32).reshape(8, 1)) & 1) << 4)
    wi = (sc[..., None] * q).reshape(r, nsb * 8, 32)
    a = d[..., None].expand(r, nsb, 8).reshape(r, nsb * 8)
    return IntForm(wi, a, (-dmin[..., None] * m.float()).reshape(r, nsb * 8))


def int_form_q4_k(raw: Tensor) -> IntForm:
    return _int_form_scale_min(raw, 144, five=False)


def int_form_q5_k(raw: Tensor) -> IntForm:
    return _int_form_scale_min(raw, 176, five=True)


# ---- q6_k -------------------------------------------------------------------------------------

_K = torch.arange(4).reshape(4, 1)  # k: the 32-input quarter of a 128-input half


def quantize_q6_k(w: Tensor) -> Tensor:
    """Per 16 inputs a signed scale mapping the largest-magnitude value to -32; the 16 scales as
    int8 multiples of one fp16 d per super-block."""
    r, c = w.shape
    nsb = c // 256
    g = w.float().reshape(r, nsb, 16, 16)
    big = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
    scale = big / -32  # [r, nsb, 16]
    d = (scale.abs().amax(-1) / 127).to(torch.float16).float()
    sc = safe_div(scale, d[..., None]).round().clamp(-127, 127)
    q = safe_div(g, (d[..., None] * sc)[..., None]).round().clamp(-32, 31).long() + 32
    q = q.reshape(r, nsb, 2, 4, 32)  # [half, k, i]
    low, top = q & 15, q >> 4
    ql = torch.cat(
        (low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)), dim=-1
    )
    qh = (top << (2 * _K)).sum(3)  # [r, nsb, 2, 32]
    parts = (
        ql.reshape(r, nsb, 128).to(torch.uint8),
        qh.reshape(r, nsb, 64).to(torch.uint8),
        sc.to(torch.int8).view(torch.uint8),
        fp16_bytes(d),
    )
    return torch.cat(parts, dim=-1).reshape(r, nsb * 210)


def int_form_q6_k(raw: Tensor) -> IntForm:
    b = raw.reshape(raw.shape[0], -1, 210)
    r, nsb = b.shape[:2]
    ql = b[..., :128].int().reshape(r, nsb, 2, 1, 2, 32)  # [half, -, k & 1, i]
    low = torch.cat((ql & 15, ql >> 4), dim=3).reshape(r, nsb, 2, 4, 32)  # k = 2 (k >> 1) + k & 1
    qh = b[..., 128:192].int().reshape(r, nsb, 2, 1, 32)
    q = (low | (((qh >> (2 * _K.int())) & 3) << 4)) - 32  # [r, nsb, half, k, 32]
    sc = b[..., 192:208].contiguous().view(torch.int8).int().reshape(r, nsb, 8, 2, 1)
    wi = (sc * q.reshape(r, nsb, 8, 2, 16)).reshape(r, nsb * 8, 32)
    a = fp16_from(b[..., 208:210])[..., None].expand(r, nsb, 8).reshape(r, nsb * 8)
    return IntForm(wi, a, None)
