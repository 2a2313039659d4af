"""The prefill attention's bf16-dot kernels (`ftdense`, native/dense/prefill_attention_impl.h,
kDot): under the dense pool's ISA "avx512bf16" (cpu_bf16_attention; vdpbf16ps) on a bf16 KV pool, both
products take bf16 pairs: the scaled queries and the softmax weights are rounded to bf16 (nearest
even, denormals to zero), the running sum adds the rounded weights. "emubf16" runs the same
arithmetic in plain C++ on any CPU (vdpbf16ps as Intel's pseudo-code has it: per lane the odd
pair's product added first, then the even one's, each sum rounded, denormals flushed; this Zen 4
gives those bits, and so does this file's hardware check).

Checks:
- avx512bf16 against emubf16, bit for bit (skipped where the CPU lacks AVX512-BF16);
- emubf16 (and avx512bf16) against a float64 reference that makes the kernel's roundings (q * scale
  in fp32 rounded to bf16; per key block of 64 aligned to position 0, the weights e^(s - m) of the
  running max m rounded to bf16, l their sum), at rtol = atol = 2e-3: the rest of the kernel is
  fp32 (logits ~1e-6 relative, exp within 2 ulp), which may move a weight across a bf16 rounding
  boundary: one weight then differs by 2^-8 relative, an output by at most ~2^-8 w |v| / l (seen
  up to 3e-4 here, mostly ~2e-7). A wrong pair, lane, mask, tail or a key missed moves outputs by >= ~5e-3;
- the plain float64 reference (no rounding) is further off (seen 4e-3 to 5e-3), within 3e-2 (the
  q rounding moves a logit by ~2^-9 |q| |k|, the weights by that relative): the path really
  rounds;
- batch invariance: rows do not depend on the chunking, the tile or the thread count (bit for
  bit), as the fp32 kernels' (test_prefill_attention.py runs its checks on these ISAs too);
- a fp32 pool keeps the fp32 kernels' bits;
- the decode attention under these ISAs runs its queries as prompt chunks of one row on a bf16
  pool, so a decode row has the bits of the same row in a prompt (on a fp32 pool the fp32 decode
  kernel's).
"""

from __future__ import annotations

import pytest
import torch
from test_prefill_attention import (  # noqa: F401 (_restore_pool: autouse fixture)
    PAGE,
    Case,
    _reference64,
    _restore_pool,
)

from freetokend.native import dense_native

pytestmark = pytest.mark.skipif(
    not dense_native.available(), reason="ftdense extension not built (pip install -e .)"
)

TOL = 2e-3  # against the reference with the kernel's roundings (module docstring)
PLAIN_TOL = 3e-2  # against the plain float64 reference
BLOCK = 64  # kPrefillKeyBlock


def _use(isa: str, threads: int = 2) -> None:
    try:
        dense_native.configure(threads, isa=isa)
    except ValueError:
        pytest.skip(f"this CPU lacks {isa}")
    if dense_native.prefill_isa() != isa:
        pytest.skip(f"this CPU lacks {isa} (prefill kernel {dense_native.prefill_isa()})")


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 through fp32 (nearest even), as a float64 tensor."""
    return x.float().to(torch.bfloat16).double()


def _reference_rounded(
    case: Case, n: int, window: int | None, sinks: torch.Tensor | None
) -> torch.Tensor:  # fmt: skip
    """Sequence 0's rows [0, n) in float64 with the bf16-dot kernel's roundings: q * scale (fp32)
    rounded to bf16; an online softmax over key blocks of 64 aligned to 0 whose weights
    e^(s - m) (m the running max after the block) are rounded to bf16 and summed as rounded."""
    heads, kv_heads = case.heads, case.k.shape[2]
    scale = case.q.shape[-1] ** -0.5
    kpos = torch.arange(n)
    page = case.tables[0].long()[kpos // PAGE]
    k = case.k[page, kpos % PAGE].double().repeat_interleave(heads // kv_heads, dim=1)
    v = case.v[page, kpos % PAGE].double().repeat_interleave(heads // kv_heads, dim=1)
    qs = _bf16(case.q[:n] * scale)
    logits = torch.einsum("qhd,khd->hqk", qs, k)
    allowed = kpos.unsqueeze(0) <= kpos.unsqueeze(1)
    if window is not None:
        allowed &= kpos.unsqueeze(0) > kpos.unsqueeze(1) - window
    logits = logits.masked_fill(~allowed, float("-inf"))
    m = torch.full((heads, n), float("-inf"), dtype=torch.float64)
    lsum = torch.zeros(heads, n, dtype=torch.float64)
    acc = torch.zeros(heads, n, v.shape[-1], dtype=torch.float64)
    for b0 in range(0, n, BLOCK):
        s = logits[..., b0 : b0 + BLOCK]
        mn = torch.maximum(m, s.amax(dim=-1))
        seen = mn > float("-inf")
        base = torch.where(seen, mn, torch.zeros_like(mn))
        corr = torch.where(seen, torch.exp(m - base), torch.ones_like(mn))
        w = _bf16(torch.exp(s - base.unsqueeze(-1)))  # masked keys: e^-inf = 0
        lsum = lsum * corr + w.sum(dim=-1)
        acc = acc * corr.unsqueeze(-1) + torch.einsum("hqk,khd->hqd", w, v[b0 : b0 + BLOCK])
        m = mn
    if sinks is not None:
        lsum = lsum + torch.exp(sinks.double().view(heads, 1) - m)
    return (acc / lsum.unsqueeze(-1)).permute(1, 0, 2)


CASES = [  # heads, kv_heads, d, n, window, sinks
    (8, 2, 64, 300, None, False),
    (4, 4, 128, 129, None, True),  # an odd last block (one key)
    (6, 2, 32, 201, 40, True),
    (2, 1, 256, 150, None, False),
    (8, 1, 16, 77, 70, False),
]


@pytest.mark.parametrize("isa", ["emubf16", "avx512bf16"])
@pytest.mark.parametrize("heads,kv_heads,d,n,window,sinks", CASES, ids=str)
def test_matches_the_rounded_reference(
    isa: str, heads: int, kv_heads: int, d: int, n: int, window: int | None, sinks: bool
) -> None:
    """A whole prompt and the same prompt in ragged chunks (odd lengths, starts inside a block):
    within TOL of the reference with the kernel's roundings, within PLAIN_TOL of the plain one
    and further from it; the chunked rows keep the whole prompt's bits."""
    _use(isa)
    case = Case(heads, kv_heads, d, [n], torch.bfloat16, seed=3 * d + heads)
    sk = torch.randn(heads) * 2 if sinks else None
    got = case.run([(0, 0, n)], window, sk).double()
    want = _reference_rounded(case, n, window, sk)
    plain = _reference64(case, n, window, sk)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    torch.testing.assert_close(got, plain, rtol=PLAIN_TOL, atol=PLAIN_TOL)
    assert (got - plain).abs().max() > 4 * (got - want).abs().max()  # it rounds
    cuts = [c for c in (1, 37, 64, 101, 102) if c < n]
    chunked = case.run(case.chunks([cuts]), window, sk).double()
    assert torch.equal(chunked, got)


def test_the_instruction_matches_its_emulation() -> None:
    """avx512bf16 (vdpbf16ps) gives the bits of emubf16 (its emulation): several chunks of odd
    lengths in one call, a window and sinks; K/V with tiny values (bf16 denormals, products
    below fp32's normal range) and large ones."""
    try:
        dense_native.configure(2, isa="avx512bf16")
    except ValueError:
        pytest.skip("this CPU lacks avx512bf16")
    if dense_native.prefill_isa() != "avx512bf16":
        pytest.skip("this CPU lacks avx512bf16")
    for seed, (heads, kv_heads, d) in enumerate([(8, 2, 64), (32, 4, 128), (6, 3, 48)]):
        case = Case(heads, kv_heads, d, [250, 91, 140], torch.bfloat16, seed=seed)
        g = torch.Generator().manual_seed(seed)
        tiny = torch.rand(case.k.shape, generator=g) < 0.05
        case.k = torch.where(tiny, case.k.float() * 1e-39, case.k.float()).to(torch.bfloat16)
        case.v = torch.where(tiny, case.v.float() * 1e-37, case.v.float() * 50).to(torch.bfloat16)
        chunks = case.chunks([[63, 129], [1, 2], []])
        sk = torch.randn(heads)
        outs = {}
        for isa in ("avx512bf16", "emubf16"):
            dense_native.configure(2, isa=isa)
            for window in (None, 45):
                outs[isa, window] = case.run(chunks, window, sk)
        for window in (None, 45):
            assert torch.equal(outs["avx512bf16", window], outs["emubf16", window]), (seed, window)


@pytest.mark.parametrize("isa", ["emubf16", "avx512bf16"])
def test_tiles_and_threads_keep_the_bits(isa: str) -> None:
    """A long prompt whole (tiles of many rows) on 1 and 2 threads, and row by row (tiles of one
    row): the same bits."""
    _use(isa)
    case = Case(16, 2, 64, [200], torch.bfloat16, seed=11)
    whole = case.run([(0, 0, 200)], 50, None)
    _use(isa, 1)
    assert torch.equal(case.run([(0, 0, 200)], 50, None), whole)
    rows = torch.zeros_like(whole)
    for p in (0, 1, 63, 64, 65, 130, 199):
        case.run([(0, p, 1)], 50, None, out=rows)
        assert torch.equal(rows[p], whole[p]), p


@pytest.mark.parametrize("isa,base", [("emubf16", "scalar"), ("avx512bf16", "avx512")])
def test_a_fp32_pool_keeps_the_fp32_kernel(isa: str, base: str) -> None:
    """On a fp32 KV pool the bf16-dot ISA runs its base fp32 kernel: the same bits."""
    _use(isa)
    case = Case(8, 2, 64, [150, 60], torch.float32, seed=4)
    chunks = case.chunks([[70], []])
    got = case.run(chunks, None, None)
    dense_native.configure(2, isa=base)
    assert torch.equal(case.run(chunks, None, None), got)


@pytest.mark.parametrize("isa", ["emubf16", "avx512bf16"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_rows_keep_the_prompts_bits(isa: str, threads: int) -> None:
    """Decode queries of three sequences at once (positions inside and at the ends of key
    blocks, a window and sinks, GQA 8 and 1), and rows of a short prompt chunk: each has the bits
    of its row of the whole prompt (decode_attention.h). On a fp32 pool the decode attention keeps the fp32 decode kernel's
    bits (the base ISA's)."""
    _use(isa, threads)
    for heads, kv_heads, d in [(32, 4, 128), (4, 4, 64)]:
        case = Case(heads, kv_heads, d, [300, 77, 140], torch.bfloat16, seed=heads + d)
        sk = torch.randn(heads)
        scale = d**-0.5
        for window, sinks in [(None, None), (50, sk)]:
            whole = case.run(case.chunks([[], [], []]), window, sinks)
            for pos in ([0, 0, 0], [63, 64, 1], [299, 76, 139], [200, 30, 128]):
                rows = torch.tensor([f + p for f, p in zip(case.first, pos, strict=True)]).int()
                lens = torch.tensor(pos).int() + 1
                got = dense_native.decode_attention(
                    case.q, case.k, case.v, case.tables, lens, scale, window, sinks, rows=rows
                )
                assert torch.equal(got[rows.long()], whole[rows.long()]), (heads, window, pos)
            # a short prompt chunk as decode rows (consecutive rows and positions of one
            # sequence: one chunk of the prefill kernel), then a row of another sequence
            seq = torch.tensor([0, 0, 0, 0, 2])
            pos = torch.tensor([62, 63, 64, 65, 139]).int()
            rows = torch.tensor([case.first[s] for s in seq.tolist()]).int() + pos
            got = dense_native.decode_attention(
                case.q, case.k, case.v, case.tables[seq], pos + 1, scale, window, sinks, rows=rows
            )
            assert torch.equal(got[rows.long()], whole[rows.long()]), (heads, window)
    case = Case(8, 2, 64, [150, 60], torch.float32, seed=4)
    lens, rows = torch.tensor([150, 31]).int(), torch.tensor([149, 180]).int()
    args = (case.q, case.k, case.v, case.tables, lens, 0.125, None, None, rows)
    got = dense_native.decode_attention(*args)[rows.long()]
    dense_native.configure(threads, isa="avx512" if isa == "avx512bf16" else "scalar")
    assert torch.equal(dense_native.decode_attention(*args)[rows.long()], got)


def test_the_engine_takes_the_bf16_attention_unless_asked_not_to() -> None:
    """cpu_bf16_dot puts the dense pool on avx512bf16 and, by default (EngineConfig's
    cpu_bf16_attention), the prefill and decode attention with it; cpu_bf16_attention off
    keeps them on the base ISA's fp32 kernels."""
    from freetokend.engine.build import cpu_isa
    from freetokend.engine.engine_config import EngineConfig
    from freetokend.experts import cpu_executor

    if "avx512bf16" not in cpu_executor.supported_isas():
        pytest.skip("this CPU lacks AVX512-BF16")
    assert EngineConfig().cpu_bf16_attention
    assert cpu_isa(True, 2, bf16_attention=True) == "avx512bf16"
    assert dense_native.prefill_isa() == "avx512bf16"
    assert cpu_isa(True, 2, bf16_attention=False) == "avx512bf16"
    assert dense_native.configured_isa() == "avx512bf16"
    assert dense_native.prefill_isa() == "avx512"  # the fp32 kernel on the base ISA
