"""Microscaled number formats, tensor by tensor, in plain torch: the bit-level codecs (e2m1 FP4
codes, nibble packing, e8m0 scales; layouts in experts/formats.py's docstring) and the
per-matrix block quantisers the expert formats are built from (MXFP4: e2m1 with an e8m0 scale
per 32 inputs; NVFP4: e2m1 with an fp8 scale per 16 and a global fp32 scale; fp8 e4m3 with an
fp32 scale per 128 x 128 block). Matrices are [R, C] fp32, blocks along C (the input dim).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


# ---- bit-level codecs -------------------------------------------------------------------------

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
E2M1_MAX = 6.0
FP8_MAX = 448.0
E8M0_BIAS = 127
# Midpoints between neighbouring e2m1 magnitudes; a value on a midpoint rounds to the code with
# an even mantissa bit (round half to even): down at 0.25, 1.25, 2.5, 5; up at 0.75, 1.75, 3.5.
_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIES_UP = (0.75, 1.75, 3.5)


def e2m1_encode(x: Tensor) -> Tensor:
    """fp32 values (already divided by their scale) -> uint8 codes 0..15, nearest, ties to even,
    saturating at +-6."""
    mag = x.float().abs().clamp(max=E2M1_MAX).contiguous()  # bucketize copies otherwise
    code = torch.bucketize(mag, _MIDS.to(x.device), right=False)  # on a midpoint: the lower code
    for tie in _TIES_UP:
        code = code + (mag == tie).long()
    return (code | (torch.signbit(x).long() << 3)).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 codes 0..15 -> fp32 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_nibbles(codes: Tensor) -> Tensor:
    """[..., C] codes -> [..., C/2] uint8; element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """[..., C/2] uint8 -> [..., C] codes; inverse of ``pack_nibbles``."""
    both = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e8m0_decode(e: Tensor) -> Tensor:
    """uint8 biased exponents -> fp32 powers of two 2^(e - 127)."""
    return torch.exp2(e.float() - E8M0_BIAS)


# ---- per-matrix block quantisers ([R, C] fp32, blocks along C, the input dim) -----------------


def mx_quant(w: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """[R, C] -> (packed [R, C/2] uint8, e8m0 scales [R, C/block] uint8).

    The scale is the smallest power of two with amax / scale <= 6, so nothing saturates."""
    r, c = w.shape
    blocks = w.float().reshape(r, c // block, block)
    amax = blocks.abs().amax(-1)
    mant, exp = torch.frexp(amax / E2M1_MAX)  # amax/6 = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)  # exact powers of two: ceil(log2) = exp - 1
    exp = torch.where(amax == 0, torch.full_like(exp, -E8M0_BIAS), exp)
    exp = exp + (amax / torch.exp2(exp.float()) > E2M1_MAX).int()  # guard the division's rounding
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = e2m1_encode(blocks / torch.exp2(exp.float()).unsqueeze(-1)).reshape(r, c)
    return pack_nibbles(codes), (exp + E8M0_BIAS).to(torch.uint8)


def mx_dequant(packed: Tensor, scales: Tensor, block: int = 32) -> Tensor:
    vals = e2m1_decode(unpack_nibbles(packed))
    return vals * e8m0_decode(scales).repeat_interleave(block, dim=-1)


def nv_quant(w: Tensor, glob: float, block: int = 16) -> tuple[Tensor, Tensor]:
    """[R, C] with the tensor's global scale -> (packed [R, C/2] uint8, fp8 scales [R, C/block])."""
    r, c = w.shape
    blocks = w.float().reshape(r, c // block, block)
    bs = (blocks.abs().amax(-1) / E2M1_MAX / glob).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    eff = (bs.float() * glob).unsqueeze(-1)  # the block's effective scale
    q = torch.where(eff > 0, blocks / torch.where(eff > 0, eff, 1.0), 0.0)
    return pack_nibbles(e2m1_encode(q).reshape(r, c)), bs


def nv_dequant(packed: Tensor, scales: Tensor, glob: Tensor, block: int = 16) -> Tensor:
    vals = e2m1_decode(unpack_nibbles(packed))
    return vals * scales.float().repeat_interleave(block, dim=-1) * glob.float()


def nv_global(w: Tensor) -> float:
    """Per-tensor scale so the largest block scale lands on fp8's max: amax / (6 * 448)."""
    amax = float(w.float().abs().max())
    return amax / (E2M1_MAX * FP8_MAX) if amax > 0 else 1.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_quant(w: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """[R, C] -> (fp8 e4m3 [R, C], fp32 scales [ceil(R/128), ceil(C/128)]); w = q * scale."""
    r, c = w.shape
    rb, cb = cdiv(r, block), cdiv(c, block)
    padded = torch.zeros(rb * block, cb * block)
    padded[:r, :c] = w.float()
    amax = padded.reshape(rb, block, cb, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (w.float() / _expand(scale, r, c, block)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def _expand(scale: Tensor, r: int, c: int, block: int) -> Tensor:
    """[Rb, Cb] block scales -> [r, c] per element."""
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:r, :c]


def fp8_dequant(q: Tensor, scale: Tensor, block: int = 128) -> Tensor:
    return q.float() * _expand(scale.float(), q.shape[0], q.shape[1], block)
