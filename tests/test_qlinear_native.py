"""Native integer-dot projections with GGUF block weights (ftdense.qlinear) against the plain
torch reference that quantises the activations the same way (gguf_blocks.qdot_reference).

Every ISA path runs here when the CPU has it and is skipped with the reason otherwise: "vnni"
(AVX512-VNNI vpdpbusd), "avx2" (maddubs), "scalar". The activation quantisation must match the
reference bit for bit. The dot products are exact integers per block, combined in fp32 in a
different order: with weights scaled so outputs are of order 1, differences are ~1e-6, so
rtol = atol = 1e-4 (a wrong block, scale, nibble or token shifts results by >= 1e-2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from native_support import single_threaded_reference  # noqa: F401 (autouse fixture)

from freetokend.formats import gguf_blocks as gb
from freetokend.formats import gguf_interleave as gi
from freetokend.native import dense_native
from freetokend.native import qlinear_native as ql
from freetokend.runtime import cpu_isa

pytestmark = pytest.mark.skipif(
    not ql.available(), reason="ftdense extension not built (pip install -e .)"
)

RTOL = ATOL = 1e-4
ISAS = ["vnni", "avx2", "scalar"]
FMTS = list(gb.QTYPE_CODES)  # q8_0 q4_k q6_k q5_k mxfp4 q5_0 q4_0
_WHAT = {"vnni": "AVX512-VNNI (+VL)", "avx2": "AVX2+FMA+F16C", "scalar": ""}


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    dense_native.configure(2)
    yield


def _need(isa: str) -> None:
    if isa not in ql.isas():
        pytest.skip(
            f"this CPU lacks {_WHAT[isa]}: the {isa} qdot path cannot run here (runs: {ql.isas()})"
        )


def _case(t: int, n: int, k: int, fmt: str, seed: int = 0) -> tuple[torch.Tensor, ql.QuantWeight]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x[0, :32] = 0.0  # an all-zero activation block (scale 0)
    w = torch.randn(n, k, generator=g) / k**0.5
    return x, ql.QuantWeight.from_float(w, fmt)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [32, 256])
def test_activation_quantisation_bit_exact(isa: str, group: int) -> None:
    _need(isa)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 512, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    x[1, 40:72] = 0.0
    x[2, :32] = torch.arange(32) - 15.5  # amax 16.5: halves of 127/16.5 steps, ties included
    x[3, 256:] = 0.0  # an all-zero group of 256
    for got, want in zip(ql.quantize_act(x, isa, group), gb.quantize_act(x, group), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("isa", ISAS)
def test_fp16_activation_scales_bit_exact(isa: str) -> None:
    """llama.cpp's rounding (set_fp16_act_scales): 32-input scales on fp16 values, subnormal
    (amax below 127 * 2^-14) and beyond fp16's range (kept in fp32) included; 256-input
    groups untouched."""
    _need(isa)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 512, generator=g) * torch.logspace(-6, 7, 7)[:, None]
    plain = gb.quantize_act(x, 32)
    ql.set_fp16_act_scales(True)
    try:
        for group in (32, 256):
            for got, want in zip(
                ql.quantize_act(x, isa, group), gb.quantize_act(x, group), strict=True
            ):
                assert torch.equal(got, want)
        d = gb.quantize_act(x, 32)[1]
    finally:
        ql.set_fp16_act_scales(False)
    d16 = plain[1].to(torch.float16).float()
    assert torch.equal(d[:-1], d16[:-1]) and not torch.equal(d, plain[1])
    assert torch.equal(d[-1], plain[1][-1])  # amax ~1e7: beyond fp16, kept
    assert torch.equal(ql.quantize_act(x, isa, 32)[1], plain[1])  # off again


def test_input_permutation() -> None:
    """QuantWeight.in_perm: blocks whose inputs are in another order than the model's (input j
    of the blocks is model input in_perm[j]) compute x @ W^T on the model's x, alone and beside
    a plain weight in one qlinear_many, and dequantize to the model's order."""

    g = torch.Generator().manual_seed(9)
    w = torch.randn(40, 256, generator=g) / 16
    perm = torch.randperm(256, generator=g)
    file_w = w[:, perm]  # the file's column j holds the model's input perm[j]
    qw = dataclasses.replace(ql.QuantWeight.from_float(file_w, "q8_0"), in_perm=perm)
    plain = ql.QuantWeight.from_float(w, "q4_k")
    x = torch.randn(3, 256, generator=g)
    assert torch.equal(qw.dequantize(), gb.dequantize(qw.gguf_raw(), "q8_0")[:, perm.argsort()])
    assert (qw.dequantize() - w).abs().max() < 0.01
    got, other = ql.qlinear_many(x, [qw, plain])
    torch.testing.assert_close(got, ql.qlinear_reference(x, qw), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(other, ql.qlinear_reference(x, plain), rtol=RTOL, atol=ATOL)
    assert ((got - x @ w.t()).norm() / (x @ w.t()).norm()).item() < 0.02
    unpermuted = ql.qlinear(x, dataclasses.replace(qw, in_perm=None))
    assert (unpermuted - got).abs().max() > 0.1  # the order matters


def test_qlinear_many_mixes_activation_groups() -> None:
    """One call with outputs of both groups (a GGUF Q4_K_M file's q/k/v can be Q4_K, Q6_K and
    Q5_0): each reads the input quantised in its own group, as the reference does."""
    x, w32 = _case(3, 40, 512, "q5_0", seed=5)
    x = x * torch.linspace(0.05, 3.0, 512)  # group amaxes far from their 32-input blocks'
    _, wk = _case(3, 70, 512, "q4_k", seed=6)
    _, w6 = _case(3, 9, 512, "q6_k", seed=7)
    outs = ql.qlinear_many(x, [w32, wk, w6])
    for got, w in zip(outs, [w32, wk, w6], strict=True):
        torch.testing.assert_close(got, ql.qlinear_reference(x, w), rtol=RTOL, atol=ATOL)
    # the group matters at this tolerance: the K-quant output read with 32-input groups parts
    as32 = gb.qdot_reference(wk.gguf_raw(), "q4_k", x, group=32)
    assert (as32 - outs[1]).abs().max().item() > 100 * ATOL


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("t", [1, 2, 3, 9, 17])
def test_qlinear_matches_reference(isa: str, fmt: str, t: int) -> None:
    _need(isa)
    # 71 rows: one full 64-row task and a partial one; K = 768 is 3 super-blocks of 256 and 24
    # blocks of 32; T = 9 and 17 take groups of 4 tokens and a lone one.
    x, w = _case(t, 71, 768, fmt)
    got = ql.qlinear(x, w, isa=isa)
    torch.testing.assert_close(got, ql.qlinear_reference(x, w), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("fmt", FMTS)
def test_qlinear_many_shares_the_input_and_adds_bias(fmt: str) -> None:
    x, w1 = _case(4, 20, 512, fmt, seed=1)
    _, w2 = _case(4, 33, 512, fmt, seed=2)
    b = torch.randn(33)
    y1, y2 = ql.qlinear_many(x, [w1, w2], [None, b])
    torch.testing.assert_close(y1, ql.qlinear_reference(x, w1), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(y2, ql.qlinear_reference(x, w2, b), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FMTS)
def test_many_tokens_and_oracle(isa: str, fmt: str) -> None:
    """Prefill-sized batch (two token chunks of qlinear.cpp for K = 4096: 64 + 6 tokens); and the
    dequantised oracle x @ W^T within the activation quantisation's error."""
    _need(isa)
    x, w = _case(70, 24, 4096, fmt, seed=4)
    got = ql.qlinear(x, w, isa=isa)
    torch.testing.assert_close(got, ql.qlinear_reference(x, w), rtol=RTOL, atol=ATOL)
    oracle = x @ w.dequantize().t()
    assert ((got - oracle).norm() / oracle.norm()).item() < 0.01


def test_raw_gguf_rows_and_errors() -> None:
    x, w = _case(2, 8, 256, "q4_k")
    same = ql.QuantWeight.from_raw(w.gguf_raw().clone(), "q4_k", 256)
    assert torch.equal(ql.qlinear(x, same), ql.qlinear(x, w))
    with pytest.raises(ValueError, match="uint8"):
        ql.QuantWeight.from_raw(w.raw[:, :-1], "q4_k", 256)
    with pytest.raises(ValueError, match="cannot hold"):
        ql.QuantWeight.from_raw(w.raw, "q4_k", 200)
    with pytest.raises(ValueError, match="features"):
        ql.qlinear(torch.zeros(1, 512), w)
    with pytest.raises(ValueError, match="this CPU runs|isa"):
        ql.qlinear(x, w, isa="sve")


def test_dispatch_follows_the_configured_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_isa.ENV, raising=False)  # "auto" as the CPU picks it (make test-isas)
    dense_native.configure(2)
    best = ql.isas()[0]
    assert ql.configured_isa() == best  # "auto": vnni where the CPU has it
    dense_native.configure(2, isa="scalar")
    assert ql.configured_isa() == "scalar"
    if "avx2" in ql.isas():
        dense_native.configure(2, isa="avx2")
        assert ql.configured_isa() == "avx2"
    if "vnni" in ql.isas():  # the dense AVX-512 path pairs with vpdpbusd
        dense_native.configure(2, isa="avx512")
        assert ql.configured_isa() == "vnni"


@pytest.mark.parametrize("fmt", sorted(gi.INTERLEAVED_CODES))
def test_interleave_round_trip_and_layout(fmt: str) -> None:
    """``interleave`` is a byte permutation within each group of 8 rows, undone by
    ``deinterleave`` (native/dense/qdot.h's layouts: a super-block of a group starts with the 8
    rows' fp16 d)."""
    raw = gb.quantize(torch.randn(27, 512) / 20, fmt)  # 3 groups and 3 plain rows
    packed = gi.interleave(raw, fmt)
    assert torch.equal(packed[24:], raw[24:])
    assert torch.equal(packed, gi.interleave(raw, fmt, native=False))  # native vs torch
    assert torch.equal(gi.deinterleave(packed, fmt), gi.deinterleave(packed, fmt, native=False))
    raw = raw[:24]
    assert torch.equal(gi.interleave(raw, fmt), packed[:24])
    packed = packed[:24]
    assert packed.shape == raw.shape and not torch.equal(packed, raw)
    assert torch.equal(gi.deinterleave(packed, fmt), raw)
    # the native byte moves (used at load) against the torch permutes
    assert torch.equal(packed, gi.interleave(raw, fmt, native=False))
    assert torch.equal(gi.deinterleave(packed, fmt, native=False), raw)
    d_at = {
        "q4_k": slice(0, 2),
        "q6_k": slice(208, 210),
        "mxfp4": slice(0, 1),
        "q8_0": slice(0, 2),
        "q5_k": slice(0, 2),
    }[fmt]
    n = 8 * (d_at.stop - d_at.start)  # d of rows 0..7 (mxfp4: the first block's e8m0 bytes)
    assert torch.equal(packed[:8].reshape(-1)[:n], raw[:8, d_at].reshape(-1))
    # the second group starts where row 8 does, with its own rows' bytes only
    assert torch.equal(packed[8:16].reshape(-1).sort().values, raw[8:16].reshape(-1).sort().values)
    assert gi.interleavable(fmt, 16) and gi.interleavable(fmt, 12) and not gi.interleavable(fmt, 7)
    with pytest.raises(ValueError, match="R >= 8"):
        gi.interleave(raw[:7], fmt)
    assert not gi.interleavable("q5_0", 16)
    with pytest.raises(ValueError, match="no interleaved layout"):
        gi.interleave(gb.quantize(torch.randn(8, 64), "q5_0"), "q5_0")


@pytest.mark.parametrize("simd", [False, True])
@pytest.mark.parametrize("fmt", sorted(gi.INTERLEAVED_CODES))
def test_native_interleave_moves_equal_the_torch_permutes(fmt: str, simd: bool) -> None:
    """ftdense.qinterleave's scalar moves and its AVX2 transposes (where the CPU has AVX2;
    otherwise the scalar moves again) give the torch reference's bytes, both ways, on random
    bytes (every byte's place checked) over several super-blocks, groups and a tail."""
    import ftdense

    blocks = 3 if fmt in ("q4_k", "q5_k", "q6_k") else 5
    nbytes = blocks * gb.BLOCK_BYTES[fmt]
    raw = torch.randint(0, 256, (8 * 4 + 5, nbytes), dtype=torch.uint8)
    want = gi.interleave(raw, fmt, native=False)
    cols = blocks * gb.BLOCK_INPUTS[fmt]
    code = gb.QTYPE_CODES[fmt]
    got = torch.empty_like(raw)
    ftdense.qinterleave(code, raw.data_ptr(), got.data_ptr(), raw.shape[0], cols, False, simd)
    assert torch.equal(got, want)
    back = torch.empty_like(raw)
    ftdense.qinterleave(code, want.data_ptr(), back.data_ptr(), raw.shape[0], cols, True, simd)
    assert torch.equal(back, raw)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", sorted(gi.INTERLEAVED_CODES))
@pytest.mark.parametrize("t", [1, 2, 3, 5, 40])
@pytest.mark.parametrize("rows", [48, 77, 2053])
def test_interleaved_rows_match_the_reference(isa: str, fmt: str, t: int, rows: int) -> None:
    """Rows interleaved by 8 (the layout the constructors pick for q4_k and q6_k): every ISA's
    group kernel against the reference over the GGUF rows, for one token, a few and many, with
    and without plain rows after the last whole group (77 = 9 * 8 + 5, across two 64-row tasks;
    2053 = 8 * 256 + 5, in 256-row tasks: qlinear.cpp sizes them by the rows and the pool)."""
    _need(isa)
    x, w = _case(t, rows, 768, fmt, seed=11)
    assert w.interleaved and w.code == gi.INTERLEAVED_CODES[fmt]
    plain = dataclasses.replace(w, raw=w.gguf_raw(), interleaved=False)
    got = ql.qlinear(x, w, isa=isa)
    torch.testing.assert_close(got, ql.qlinear_reference(x, w), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got, ql.qlinear(x, plain, isa=isa), rtol=RTOL, atol=ATOL)
    assert torch.equal(w.dequantize(), plain.dequantize())
    # read as plain rows, the interleaved bytes give other results: the layout is what is tested
    misread = dataclasses.replace(w, interleaved=False)
    assert not torch.allclose(ql.qlinear(x, misread, isa=isa), got, atol=0.1)


@pytest.fixture
def x8_streams() -> Iterator[None]:
    """Puts the one-token read mode of interleaved weights back to "auto" after a test."""
    yield
    dense_native._native.x8_streams("auto")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", sorted(gi.INTERLEAVED_CODES))
def test_one_token_stream_modes_agree(isa: str, fmt: str, x8_streams: None) -> None:
    """The two ways one token reads interleaved rows (row_tasks.h: two groups side by side with
    requests, where the ISA has pair kernels, or one group a call with none) give the same
    floats; "auto" picks single on AMD CPUs with AVX-512, pair elsewhere."""
    _need(isa)
    nat = dense_native._native
    x, w = _case(1, 2053, 768, fmt, seed=5)
    assert nat.x8_streams("pair") == "pair"
    pair = ql.qlinear(x, w, isa=isa)
    assert nat.x8_streams("single") == "single"
    single = ql.qlinear(x, w, isa=isa)
    assert torch.equal(pair, single)
    torch.testing.assert_close(single, ql.qlinear_reference(x, w), rtol=RTOL, atol=ATOL)
    assert nat.x8_streams("") == "single"  # "" reads the mode
    info = {}
    for ln in open("/proc/cpuinfo"):
        key, _, value = ln.partition(":")
        info.setdefault(key.strip(), value.strip())
    single = info.get("vendor_id") == "AuthenticAMD" and "avx512f" in info.get("flags", "").split()
    assert nat.x8_streams("auto") == ("single" if single else "pair")
    with pytest.raises(ValueError, match="auto, pair or single"):
        nat.x8_streams("triple")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t", [1, 4, 6])
def test_interleaved_mxfp4_any_block_count_and_every_scale(isa: str, t: int) -> None:
    """MXFP4_X8's unit is one block of 32 inputs: K = 96 (no super-block) works, and every e8m0
    byte the blocks can hold, subnormal half scales (e < 2) included, scales as the plain rows'
    table (e8m0_half) does; random codes cover all 16 values, signs included."""
    _need(isa)
    g = torch.Generator().manual_seed(3)
    rows, k = 24, 96
    raw = torch.randint(0, 256, (rows, k // 32, 17), dtype=torch.uint8, generator=g)
    raw[..., 0] = (
        torch.tensor([0, 1, 2, 3, 100, 127, 128, 140], dtype=torch.uint8)
        .repeat(rows * (k // 32) // 8)
        .view(rows, k // 32)
    )
    w = ql.QuantWeight.from_raw(raw.view(rows, -1), "mxfp4", k)
    assert w.interleaved and w.code == gi.INTERLEAVED_CODES["mxfp4"]
    plain = dataclasses.replace(w, raw=w.gguf_raw(), interleaved=False)
    x = torch.randn(t, k, generator=g)
    got = ql.qlinear(x, w, isa=isa)
    ref = ql.qlinear_reference(x, w)
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL * float(ref.abs().max()))
    torch.testing.assert_close(got, ql.qlinear(x, plain, isa=isa), rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t", [1, 4, 7])
def test_interleaved_q8_0_extreme_bytes(isa: str, t: int) -> None:
    """Q8_0_X8 at the int8 extremes: weights of -128 and 127 (the VNNI kernel flips every byte
    to q + 128 and takes 128 x the block's activation sum off; AVX2 takes |q| against x signed
    by q, whose maddubs pairs would saturate on the flipped bytes) against activations at
    +-127 (a token of +-max), with K = 96 (three blocks, no super-block): exact integer block
    sums, so the same floats as the plain rows."""
    _need(isa)
    g = torch.Generator().manual_seed(5)
    rows, k = 24, 96
    q = torch.randint(-128, 128, (rows, k // 32, 32), dtype=torch.int8, generator=g)
    q[:8] = torch.where(q[:8] >= 0, 127, -128).to(torch.int8)  # a group of extremes only
    d = (torch.rand(rows, k // 32, 1, generator=g) * 0.01 + 1e-3).half()
    raw = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).view(rows, -1)
    w = ql.QuantWeight.from_raw(raw, "q8_0", k)
    assert w.interleaved and w.code == gi.INTERLEAVED_CODES["q8_0"]
    plain = dataclasses.replace(w, raw=w.gguf_raw(), interleaved=False)
    x = torch.randn(t, k, generator=g)
    x[0] = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)  # every activation byte at +-127
    got = ql.qlinear(x, w, isa=isa)
    ref = ql.qlinear_reference(x, w)
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL * float(ref.abs().max()))
    torch.testing.assert_close(got, ql.qlinear(x, plain, isa=isa), rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 9])
def test_interleaved_q6_k_isas_agree_bit_for_bit(t: int) -> None:
    """The VNNI q6_k group kernel sums each 16-input group in int32 and scales it once (vpdpbusd),
    the AVX2 one scales every pair sum (maddubs + madd): the same integers, then the same float
    steps, so the outputs are equal bit for bit, for every token count of a pass (4) and past it;
    huge activations and weights at the extremes make any int16 saturation or lost bit show."""
    _need("vnni")
    _need("avx2")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, 1024, generator=g) * 50.0
    w = torch.randn(64, 1024, generator=g)
    w[:, ::7] *= 30.0  # blocks with one large weight: scales and values at their ends
    qw = ql.QuantWeight.from_float(w, "q6_k")
    assert qw.interleaved
    got = ql.qlinear(x, qw, isa="vnni")
    assert torch.equal(got, ql.qlinear(x, qw, isa="avx2"))
    torch.testing.assert_close(got, ql.qlinear_reference(x, qw), rtol=RTOL, atol=ATOL * 100)


def _first_block_at_top(w: ql.QuantWeight, t: int, isa: str) -> torch.Tensor:
    """``w`` (two super-blocks) against t tokens whose activations are all +127 after their
    quantisation in the first super-block, mixed in the second (odd tokens' halved): the call's
    result, each row checked equal to the same token alone (bit for bit) and to the reference."""
    x = torch.ones(t, 512)
    x[:, 257::2] = -1.0
    x[1::2, 256:] *= 0.5
    got = ql.qlinear(x, w, isa=isa)
    for i in range(t):
        assert torch.equal(got[i : i + 1], ql.qlinear(x[i : i + 1], w, isa=isa)), i
    torch.testing.assert_close(got, ql.qlinear_reference(x, w), rtol=RTOL, atol=ATOL)
    return got


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t", [1, 4, 5])
def test_q6_k_groups_at_the_largest_sums(isa: str, t: int) -> None:
    """Every 6-bit value 0 (q - 32 = -32), every scale -128 and the activations at +127 in the
    first super-block: the largest int32 terms the Q6_K group kernels form. The VNNI kernel starts
    each 16-input accumulator at -32 times its activation sum and multiplies the result by the
    scale (16 * 32 * 127 * 128 a group, 16 groups a super-block: below 2^31, no room for a lost
    bit); the AVX2 one subtracts the same offset at the end. Both must equal the reference, each
    row of the several-token call the same token alone, and VNNI the AVX2 bits."""
    _need(isa)
    k, n = 512, 16
    block = torch.zeros(210, dtype=torch.uint8)  # ql, qh zero: every value q = 0
    block[192:208] = 0x80  # the 16 int8 scales -128
    block[208:210] = torch.tensor([0x00, 0x1C], dtype=torch.uint8)  # d 2^-8
    second = block.clone()
    second[:192] = torch.arange(192, dtype=torch.uint8) * 37  # mixed values, scales as above
    w = ql.QuantWeight.from_raw(torch.cat([block, second]).repeat(n, 1), "q6_k", k)
    assert w.interleaved
    got = _first_block_at_top(w, t, isa)
    if isa == "vnni" and "avx2" in ql.isas():
        assert torch.equal(got, _first_block_at_top(w, t, "avx2"))
    # the first super-block alone: 256 inputs of weight 2^-8 * -128 * -32 = 16 against 1
    assert got[0, 0].item() > 4096 * 0.9


def test_fewer_than_8_rows_stay_plain() -> None:
    x, w = _case(2, 7, 256, "q4_k")
    assert not w.interleaved
    torch.testing.assert_close(ql.qlinear(x, w), ql.qlinear_reference(x, w), rtol=RTOL, atol=ATOL)
    import ftdense

    y = torch.empty(2, 7)
    with pytest.raises(ValueError, match="at least 8"):  # the native check behind it
        ftdense.qlinear(
            x.data_ptr(), 2, 256, [w.raw.data_ptr()], [7], [gi.INTERLEAVED_CODES["q4_k"]],
            [y.data_ptr()], "",
        )  # fmt: skip


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t", [1, 3, 5])
def test_q4_k_groups_at_the_largest_sums(isa: str, t: int) -> None:
    """Every nibble 15, every 6-bit scale and min 63 and the activations at +-127 after their
    quantisation: the largest integer sums a Q4_K super-block gives (the VNNI group kernel reads
    the high nibbles in place, 16 times their value, and shifts each sub-block's sum back: it
    must neither overflow nor round), each ISA's interleaved rows against the reference."""
    _need(isa)
    k, n = 512, 16
    block = torch.full((144,), 0xFF, dtype=torch.uint8)  # scales, mins and nibbles all ones
    block[0:4] = torch.tensor([0x00, 0x1C, 0x00, 0x00], dtype=torch.uint8)  # d 2^-8, dmin 0
    raw = block.repeat(n, k // 256)
    w = ql.QuantWeight.from_raw(raw, "q4_k", k)
    assert w.interleaved
    x = torch.ones(t, k)
    x[:, 1::2] = -1.0
    x[-1, :256] = 1.0  # one token's first super-block all +127: the high nibbles' sum at its top
    got = ql.qlinear(x, w, isa=isa)
    torch.testing.assert_close(got, ql.qlinear_reference(x, w), rtol=RTOL, atol=ATOL)
    assert got[-1].abs().max().item() > 900  # 256 * 15 * 63 / 256: not cancelled out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k"])
@pytest.mark.parametrize("t", [4, 9])
def test_scale_min_groups_largest_sums_any_pass(isa: str, fmt: str, t: int) -> None:
    """Every value at its top (Q4_K 15, Q5_K 31), every 6-bit scale 63 and every token's
    activations at +127 in the first super-block: the largest sums the interleaved kernels form.
    The AVX2 passes of several tokens add maddubs pair sums in int16 for 8 steps (Q5_K: 4) before
    scaling: at these values they sit just below 2^15, so a longer run would saturate. Each row
    of the many-token call must equal the same token alone (another pass form: the int32
    accumulators) bit for bit, and the reference within the usual tolerance."""
    _need(isa)
    k, n = 512, 16
    nbytes = gb.row_bytes(fmt, 256)
    block = torch.full((nbytes,), 0xFF, dtype=torch.uint8)  # scales, mins and values all ones
    block[0:4] = torch.tensor([0x00, 0x1C, 0x00, 0x00], dtype=torch.uint8)  # d 2^-8, dmin 0
    w = ql.QuantWeight.from_raw(block.repeat(n, k // 256), fmt, k)
    assert w.interleaved
    got = _first_block_at_top(w, t, isa)
    top = 15 if fmt == "q4_k" else 31
    assert got[0, 0].item() > 256 * top * 63 / 256 * 0.99  # the first super-block not cancelled


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("t", [4, 7, 9])
def test_interleaved_k_quant_passes_equal_one_token_bit_for_bit(isa: str, fmt: str, t: int) -> None:
    """The group kernels' passes of several tokens (AVX2: 4 a pass, Q4_K's and Q6_K's inner
    loops as fixed instruction sequences, qdot_x8_avx2_runs.h; the rest of the tokens in a
    shorter pass) give each row the same bits as that token alone (the one-token form), on
    random rows and activations: 77 rows (9 groups and 5 plain rows after them) of 768 inputs
    (3 super-blocks), against the reference within the usual tolerance."""
    _need(isa)
    x, w = _case(t, 77, 768, fmt, seed=13)
    x[1] *= 40.0  # one token far larger: its own activation scales
    assert w.interleaved
    got = ql.qlinear(x, w, isa=isa)
    for i in range(t):
        assert torch.equal(got[i : i + 1], ql.qlinear(x[i : i + 1], w, isa=isa)), i
    torch.testing.assert_close(got, ql.qlinear_reference(x, w), rtol=RTOL, atol=ATOL * 40)
