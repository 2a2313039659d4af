"""GGUF block formats q8_0 / q4_k in plain torch (freetokend.models.gguf_blocks).

The byte layouts are checked against an element-by-element decoder written here from the GGUF
definitions (scalar loops, independent of the module's vectorised code) on random raw bytes, so
that GGUF files' blocks and ours mean the same thing; the quantisers against their error bounds;
the integer-dot reference against x @ dequantised W (the oracle), within the activation
quantisation's error.
"""

from __future__ import annotations

import struct

import pytest
import torch

from freetokend.models import gguf_blocks as gb


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


def test_q8_0_layout_matches_scalar_decoder() -> None:
    raw = torch.cat([_raw(3, 34, (0,), s) for s in range(4)], dim=1)  # 4 blocks per row
    got = gb.dequantize_q8_0(raw)
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
    got = gb.dequantize_q4_k(raw)
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


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_quantise_roundtrip_error(fmt: str) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 512, generator=g)
    raw = gb.quantize(w, fmt)
    assert raw.dtype == torch.uint8 and raw.shape == (16, gb.row_bytes(fmt, 512))
    back = gb.dequantize(raw, fmt)
    rel = ((back - w).norm() / w.norm()).item()
    # q8_0: half a step of amax/127 (~0.006 rms on gaussians); q4_k: 4-bit asymmetric sub-blocks
    # of 32 (~0.08 rms); a wrong layout or scale would give errors of order 1.
    assert rel < (0.01 if fmt == "q8_0" else 0.1)
    if fmt == "q8_0":  # per element within half a step of the block's scale
        step = (w.reshape(16, -1, 32).abs().amax(-1) / 127).repeat_interleave(32, -1)
        assert bool(((back - w).abs() <= step * 0.5 + 1e-3 * step + 1e-6).all())
        assert torch.equal(gb.quantize(back, fmt), raw)  # and idempotent


def test_zero_and_constant_rows() -> None:
    w = torch.zeros(2, 256)
    w[1] = 3.0
    for fmt in ("q8_0", "q4_k"):
        back = gb.dequantize(gb.quantize(w, fmt), fmt)
        assert torch.allclose(back, w, atol=0.02)


def test_activation_quantisation() -> None:
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5] + [0.0] * 29])
    q, d, s = gb.quantize_act(x)
    assert q.dtype == torch.int8 and d.shape == (1, 2) and s.dtype == torch.int16
    assert d[0, 0] == 0 and bool((q[0, :32] == 0).all())
    assert d[0, 1].item() == pytest.approx(2 / 127)
    assert q[0, 32:35].tolist() == [64, -127, 32]  # 63.5 rounds to even (64), 31.75 to 32
    assert s[0, 1].item() == 64 - 127 + 32


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
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
