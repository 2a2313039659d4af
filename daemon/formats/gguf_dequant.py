"""Dequantization of GGUF block types at load, in torch, with the very values of the ``gguf``
package's numpy dequantizers (``gguf.quants``): the same fp32 operations in the same order
(for Q4_K, ``(d * sc) * q - dmin * m``; for Q6_K, ``(d * sc) * q``), each exact or rounded once
as numpy rounds it, so the results are equal bit for bit (tests/test_gguf_startup.py checks it).
Torch runs them vectorised over many blocks at once and on its intra-op threads, where the
numpy reference loops over groups of 16 rows in Python: about 10x faster on a token embedding
of 100M values, the largest tensor a GGUF load dequantizes where it does (under the cpu backend
the embedding stays in its blocks and ``dequantize`` takes the rows looked up, as llama.cpp's
get_rows does: models/layers/common.Embedding).

``DEQUANTIZERS``: ggml type name -> fn(raw [n, row_bytes] uint8, out [n, cols] fp32); types
without one go through the ``gguf`` package (gguf_file.GgufFile.read_float_into).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Tensor = torch.Tensor

_NIBBLE = torch.tensor([0, 4], dtype=torch.uint8)


def _f16(b: Tensor) -> Tensor:
    """[..., 2] uint8 (little-endian fp16) -> [...] fp32 (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: Tensor, groups: int, width: int) -> Tensor:
    """[nb, groups * width] uint8 -> [nb, groups, 2, width]: each group's low nibbles, then its
    high nibbles (gguf's ``qs.reshape(nb, -1, 1, w) >> [0, 4] & 15``)."""
    q = qs.reshape(qs.shape[0], groups, 1, width) >> _NIBBLE.view(1, 1, 2, 1)
    return q & 15


def _q8_0(raw: Tensor, out: Tensor) -> None:
    b = raw.reshape(-1, 34)
    d = _f16(b[:, :2])
    torch.mul(b[:, 2:].contiguous().view(torch.int8), d[:, None], out=out.view(-1, 32))


def _q4_0(raw: Tensor, out: Tensor) -> None:
    b = raw.reshape(-1, 18)
    d = _f16(b[:, :2])
    q = (_nibbles(b[:, 2:], 1, 16).reshape(-1, 32) - 8).view(torch.int8)  # wraps to -8..7
    torch.mul(d[:, None], q, out=out.view(-1, 32))


def _q5_0(raw: Tensor, out: Tensor) -> None:
    b = raw.reshape(-1, 22)
    d = _f16(b[:, :2])
    qh = b[:, 2:6].contiguous().view(torch.int32)  # bit i: input i's fifth bit
    high = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8) << 4
    q = ((_nibbles(b[:, 6:], 1, 16).reshape(-1, 32) | high) - 16).view(torch.int8)
    torch.mul(d[:, None], q, out=out.view(-1, 32))


def _scale_min(scales: Tensor) -> tuple[Tensor, Tensor]:
    """The 12 packed scale bytes of Q4_K / Q5_K -> (sc, m) [nb, 8] uint8 (6 bits each)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)
    return sc, mn


def _scale_min_k(raw: Tensor, out: Tensor, size: int, five: bool) -> None:
    b = raw.reshape(-1, size)
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min(b[:, 4:16])
    ds = (d[:, None] * sc).view(nb, 8, 1)  # fp32 products of an fp16 and a 6-bit integer
    dm = (dmin[:, None] * mn).view(nb, 8, 1)
    q = _nibbles(b[:, size - 128 :], 4, 32).reshape(nb, 8, 32)
    if five:  # bit j of qh[i]: the fifth bit of input i of sub-block j
        qh = b[:, 16:48].reshape(nb, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
        q = q | ((qh & 1) << 4)
    o = out.view(nb, 8, 32)
    torch.mul(ds, q, out=o)
    o.sub_(dm)


def _q4_k(raw: Tensor, out: Tensor) -> None:
    _scale_min_k(raw, out, 144, five=False)


def _q5_k(raw: Tensor, out: Tensor) -> None:
    _scale_min_k(raw, out, 176, five=True)


_SHIFT2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def _q6_k(raw: Tensor, out: Tensor) -> None:
    b = raw.reshape(-1, 210)
    nb = b.shape[0]
    low = _nibbles(b[:, :128], 2, 64).reshape(nb, 8, 32)  # [half, nibble, 64] in 32s
    high = (b[:, 128:192].reshape(nb, 2, 1, 32) >> _SHIFT2.view(1, 1, 4, 1)) & 3
    q = ((low | (high.reshape(nb, 8, 32) << 4)) - 32).view(torch.int8)  # wraps to -32..31
    ds = _f16(b[:, 208:210])[:, None] * b[:, 192:208].contiguous().view(torch.int8)
    torch.mul(ds.view(nb, 16, 1), q.view(nb, 16, 16), out=out.view(nb, 16, 16))


DEQUANTIZERS: dict[str, Callable[[Tensor, Tensor], None]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q5_0": _q5_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q5_0": (32, 22),
         "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}  # fmt: skip


def dequantize(raw: Tensor, type_name: str, out: Tensor | None = None) -> Tensor:
    """Raw GGUF rows [n, row_bytes] (uint8, contiguous) of ``type_name`` -> fp32 [n, cols]
    (into ``out`` when given: contiguous fp32 of that shape)."""
    inputs, size = BLOCK[type_name]
    n = raw.shape[0]
    if out is None:
        out = torch.empty(n, raw.shape[1] // size * inputs, dtype=torch.float32)
    assert raw.dtype == torch.uint8 and raw.is_contiguous() and out.is_contiguous()
    assert out.dtype == torch.float32 and out.numel() == raw.numel() // size * inputs
    if n:
        DEQUANTIZERS[type_name](raw, out)
    return out
