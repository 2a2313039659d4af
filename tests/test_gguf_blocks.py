"""GGUF block formats in plain torch (freetokend.formats.gguf_blocks).

The byte layouts are checked against the `gguf` package's dequantisers (llama.cpp's own Python
reference, an outside oracle) on random raw bytes for every format, and q8_0/q4_k also against an
element-by-element decoder written here, so that GGUF files' blocks and ours mean the same thing;
our quantisers' bytes decode the same through `gguf`; the quantisers meet their error bounds; the
integer-dot reference matches x @ dequantised W (the oracle) within the activation
quantisation's error.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf import quants

from freetokend.formats import gguf_blocks as gb

FMTS = list(gb.QTYPE_CODES)
GGUF_TYPES = {
    "q8_0": G.Q8_0,
    "q4_k": G.Q4_K,
    "q6_k": G.Q6_K,
    "q5_k": G.Q5_K,
    "mxfp4": G.MXFP4,
    "q5_0": G.Q5_0,
    "q4_0": G.Q4_0,
}
FP16_AT = {"q8_0": (0,), "q4_k": (0, 2), "q6_k": (208,), "q5_k": (0, 2), "q5_0": (0,), "q4_0": (0,)}
# Relative rms error of quantise -> dequantise on gaussian rows; a wrong layout or scale gives
# errors of order 1. Measured: q8_0 0.005, q6_k 0.018, q5_k 0.038, q5_0 0.043, q4_k 0.080,
# q4_0 0.086, mxfp4 0.115 (power-of-two scales, 8 magnitudes).
ROUNDTRIP = {
    "q8_0": 0.01,
    "q6_k": 0.03,
    "q5_k": 0.06,
    "q5_0": 0.06,
    "q4_k": 0.1,
    "q4_0": 0.1,
    "mxfp4": 0.14,
}


def _half(b: bytes) -> float:
    return struct.unpack("<e", b)[0]


def _raw(rows: int, nbytes: int, scale_at: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes with sane fp16 values at the given byte offsets of every block."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, nbytes), generator=g, dtype=torch.uint8)
    for off in scale_at:
        vals = (torch.rand(rows, generator=g) * 0.1 + 0.01).to(torch.float16)
        raw[:, off : off + 2] = vals.view(torch.uint8).reshape(rows, 2)
    return raw


def _gguf_dequantize(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw.numpy(), GGUF_TYPES[fmt]).astype(np.float32))


@pytest.mark.parametrize("fmt", FMTS)
def test_layout_matches_gguf_package(fmt: str) -> None:
    """Random blocks (every bit pattern of values, scales, mins, exponents) decode as `gguf`."""
    nb = gb.BLOCK_BYTES[fmt]
    raw = torch.cat([_raw(5, nb, FP16_AT.get(fmt, ()), s) for s in range(3)], dim=1)
    want = _gguf_dequantize(raw, fmt)
    assert bool(want.isfinite().all())
    torch.testing.assert_close(gb.dequantize(raw, fmt), want, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("fmt", FMTS)
def test_our_blocks_decode_through_gguf(fmt: str) -> None:
    w = torch.randn(6, 512, generator=torch.Generator().manual_seed(5))
    raw = gb.quantize(w, fmt)
    torch.testing.assert_close(
        gb.dequantize(raw, fmt), _gguf_dequantize(raw, fmt), rtol=1e-6, atol=0.0
    )


def test_q8_0_layout_matches_scalar_decoder() -> None:
    raw = torch.cat([_raw(3, 34, (0,), s) for s in range(4)], dim=1)  # 4 blocks per row
    got = gb.dequantize(raw, "q8_0")
    assert got.shape == (3, 128)
    for r in range(3):
        row = bytes(raw[r].tolist())
        for b in range(4):
            blk = row[34 * b : 34 * b + 34]
            d = _half(blk[:2])
            for i in range(32):
                q = struct.unpack("b", blk[2 + i : 3 + i])[0]
                assert got[r, 32 * b + i].item() == pytest.approx(d * q, rel=1e-6, abs=1e-9)


def test_q4_k_layout_matches_scalar_decoder() -> None:
    raw = _raw(2, 144, (0, 2), 7)
    got = gb.dequantize(raw, "q4_k")
    assert got.shape == (2, 256)
    for r in range(2):
        blk = bytes(raw[r].tolist())
        d, dmin, s, qs = _half(blk[0:2]), _half(blk[2:4]), blk[4:16], blk[16:]
        for j in range(8):
            if j < 4:
                sc, m = s[j] & 63, s[j + 4] & 63
            else:
                sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)
                m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
            for i in range(32):
                byte = qs[32 * (j // 2) + i]
                q = (byte >> 4) if j % 2 else (byte & 0xF)
                want = d * sc * q - dmin * m
                assert got[r, 32 * j + i].item() == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("fmt", FMTS)
def test_quantise_roundtrip_error(fmt: str) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 512, generator=g)
    raw = gb.quantize(w, fmt)
    assert raw.dtype == torch.uint8 and raw.shape == (16, gb.row_bytes(fmt, 512))
    back = gb.dequantize(raw, fmt)
    assert ((back - w).norm() / w.norm()).item() < ROUNDTRIP[fmt]
    if fmt == "q8_0":  # per element within half a step of the block's scale
        step = (w.reshape(16, -1, 32).abs().amax(-1) / 127).repeat_interleave(32, -1)
        assert bool(((back - w).abs() <= step * 0.5 + 1e-3 * step + 1e-6).all())
        assert torch.equal(gb.quantize(back, fmt), raw)  # and idempotent
    if fmt == "mxfp4":  # no clipping: |error| <= half the widest gap (8 -> 12) of the doubled
        # grid, 2 units of the scale s, and s < amax / 6 (the smallest power of two >= amax / 12)
        amax = w.reshape(16, -1, 32).abs().amax(-1).repeat_interleave(32, -1)
        assert bool(((back - w).abs() <= amax / 3).all())


def test_zero_and_constant_rows() -> None:
    w = torch.zeros(2, 256)
    w[1] = 3.0
    for fmt in FMTS:
        back = gb.dequantize(gb.quantize(w, fmt), fmt)
        assert torch.allclose(back, w, atol=0.02), fmt


def test_activation_quantisation() -> None:
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5] + [0.0] * 29])
    q, d, s = gb.quantize_act(x)
    assert q.dtype == torch.int8 and d.shape == (1, 2) and s.dtype == torch.int16
    assert d[0, 0] == 0 and bool((q[0, :32] == 0).all())
    assert d[0, 1].item() == pytest.approx(2 / 127)
    assert q[0, 32:35].tolist() == [64, -127, 32]  # 63.5 rounds to even (64), 31.75 to 32
    assert s[0, 1].item() == 64 - 127 + 32


def test_activation_quantisation_in_groups_of_256() -> None:
    """llama.cpp's Q8_K: one scale 1 / (127 / amax) per 256 inputs, amax over all of them."""
    x = torch.zeros(1, 512)
    x[0, :3] = torch.tensor([1.0, -2.0, 0.5])
    x[0, 200] = 4.0  # the group's amax, in another block of 32
    q, d, s = gb.quantize_act(x, 256)
    assert d.shape == (1, 16) and bool((d[0, :8] == 1 / (127 / 4.0)).all())
    assert bool((d[0, 8:] == 0).all()) and bool((q[0, 256:] == 0).all())
    assert q[0, :3].tolist() == [32, -64, 16] and q[0, 200].item() == 127  # 31.75 -> 32
    assert s[0, 0].item() == 32 - 64 + 16 and s[0, 6].item() == 127


@pytest.mark.parametrize("fmt", FMTS)
def test_qdot_reference_against_dequantised_oracle(fmt: str) -> None:
    g = torch.Generator().manual_seed(2)
    k = 512
    w = torch.randn(40, k, generator=g) / k**0.5
    x = torch.randn(5, k, generator=g)
    raw = gb.quantize(w, fmt)
    oracle = x @ gb.dequantize(raw, fmt).t()
    got = gb.qdot_reference(raw, fmt, x)
    # int8 activations per 32 inputs: ~0.3 % rms relative error on gaussian inputs.
    rel = ((got - oracle).norm() / oracle.norm()).item()
    assert rel < 0.01


def test_bad_shapes_are_named_errors() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        gb.quantize(torch.zeros(2, 96), "q4_k")
    with pytest.raises(ValueError, match="unknown block format"):
        gb.quantize(torch.zeros(2, 64), "q3_k")
