"""Native decode attention over the paged KV pool (`ftdense`) against plain-torch references.

Tolerance: both sides compute in fp32 from the same stored K/V (bf16 pages widen exactly), so
they differ only in summation order and in the native exp (within 2 ulp of expf). Outputs are
convex combinations of V entries of order 1, so differences stay ~1e-6; rtol = atol = 2e-5. A
wrong page, row, head or a missing key moves an output by >= ~1e-3 (one key of 300 carries
weight ~1/300), far above that.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from native_isa import force_isa

from freetokend.kv.pool import KVPool
from freetokend.models.layers.attention import attend
from freetokend.native import dense_native

pytestmark = pytest.mark.skipif(
    not dense_native.available(), reason="ftdense extension not built (pip install -e .)"
)

RTOL = ATOL = 2e-5
PAGE = 16
# Forced ISA -> the attention kernel it selects ("avx512" runs the AVX2 kernel, "emu512" the
# scalar one); ISAs this CPU lacks are skipped.
ISAS = {"avx2": "avx2", "avx512": "avx2", "scalar": "scalar", "emu512": "scalar"}


@pytest.fixture(autouse=True)
def _restore_pool() -> Iterator[None]:
    yield
    dense_native.configure(2)


def _use(isa: str, threads: int = 2) -> None:
    """Forces `isa` (skips the test if this CPU lacks it)."""
    import ftdense  # type: ignore[import-not-found]

    force_isa(isa, threads, ftdense.attention_isa, ISAS[isa])


def _pages(
    num_pages: int, kv_heads: int, d: int, dtype: torch.dtype, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    return k, v


def _tables(lens: list[int], num_pages: int, g: torch.Generator) -> torch.Tensor:
    """Scattered page tables: each sequence gets a random permutation of the pool's pages."""
    width = max(-(-n // PAGE) for n in lens)
    return torch.stack([torch.randperm(num_pages, generator=g)[:width] for _ in lens]).int()


def _agrees(*args: object) -> None:
    """The native kernel and the torch reference agree on these arguments."""
    torch.testing.assert_close(
        dense_native.decode_attention(*args),  # type: ignore[arg-type]
        dense_native.decode_attention_reference(*args),  # type: ignore[arg-type]
        rtol=RTOL,
        atol=ATOL,
    )


def test_forced_isa_picks_kernel() -> None:
    """Every ISA that can be forced selects its attention kernel (AVX-512 machines run AVX2)."""
    import ftdense  # type: ignore[import-not-found]

    ran = 0
    for isa, kernel in ISAS.items():
        try:
            dense_native.configure(2, isa=isa)
        except ValueError:
            continue  # this CPU lacks it
        assert ftdense.attention_isa() == kernel
        ran += 1
    assert ran >= 2  # scalar and emu512 run anywhere


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
def test_matches_reference(dtype: torch.dtype, ratio: int, d: int) -> None:
    g = torch.Generator().manual_seed(ratio * 1000 + d)
    kv_heads = 2 if ratio == 8 else 4
    heads = kv_heads * ratio
    kp, vp = _pages(40, kv_heads, d, dtype, g)
    lens = [1, 17, 300]  # one key; a partial second page; many pages and several key tiles
    tables = _tables(lens, 40, g)
    q = 2 * torch.randn(len(lens), heads, d, generator=g)  # peaked softmax as well as flat
    sinks = torch.randn(heads, generator=g)
    for window, sk in [(None, None), (None, sinks), (100, None), (100, sinks), (5, sinks)]:
        args = (q, kp, vp, tables, torch.tensor(lens), d**-0.5, window, sk)
        want = dense_native.decode_attention_reference(*args)
        for isa in ("avx2", "scalar"):
            _use(isa)
            got = dense_native.decode_attention(*args)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_context_split_over_threads(isa: str, threads: int) -> None:
    """One sequence, 2500 keys: one thread folds 64-key blocks of every KV head in turn; more
    threads split the keys into ranges (and the KV heads into groups) whose partial softmax
    states are merged."""
    _use(isa, threads)
    g = torch.Generator().manual_seed(7)
    kp, vp = _pages(200, 4, 128, torch.bfloat16, g)
    tables = _tables([2500], 200, g)
    q = torch.randn(1, 32, 128, generator=g)
    sinks = torch.randn(32, generator=g)
    for window, sk in [(None, None), (1200, sinks)]:
        _agrees(q, kp, vp, tables, torch.tensor([2500]), 128**-0.5, window, sk)


def test_head_dim_not_multiple_of_8() -> None:
    """d = 40 cannot take the 8-lane kernel: it falls back to the scalar one."""
    _use("avx2")
    g = torch.Generator().manual_seed(3)
    kp, vp = _pages(10, 2, 40, torch.bfloat16, g)
    tables = _tables([33, 70], 10, g)
    q = torch.randn(2, 6, 40, generator=g)
    _agrees(q, kp, vp, tables, torch.tensor([33, 70]), 0.3, None, None)


def test_rows_pick_queries_and_leave_other_rows() -> None:
    """``rows`` selects decode rows inside a larger flat batch; the other rows of ``out`` keep
    what they held."""
    g = torch.Generator().manual_seed(5)
    kp, vp = _pages(20, 4, 64, torch.bfloat16, g)
    lens = torch.tensor([40, 9])
    tables = _tables([40, 9], 20, g)
    q = torch.randn(6, 16, 64, generator=g)
    out = torch.full_like(q, 7.0)
    rows = torch.tensor([4, 1])
    dense_native.decode_attention(q, kp, vp, tables, lens, 0.125, rows=rows, out=out)
    ref = dense_native.decode_attention_reference(q[rows], kp, vp, tables, lens, 0.125)
    torch.testing.assert_close(out[rows], ref, rtol=RTOL, atol=ATOL)
    assert bool((out[[0, 2, 3, 5]] == 7.0).all())


@pytest.mark.parametrize(
    "lens, table, message",
    [([0], [0], "context length"), ([17], [0], "context length"), ([5], [99], "page id")],
)
def test_rejects_bad_input(lens: list[int], table: list[int], message: str) -> None:
    """Lengths beyond the table and page ids outside the pool fail before any memory is read."""
    kp, vp = _pages(4, 1, 8, torch.float32, torch.Generator().manual_seed(0))
    q = torch.randn(1, 1, 8)
    with pytest.raises(ValueError, match=message):
        dense_native.decode_attention(q, kp, vp, torch.tensor([table]), torch.tensor(lens), 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_attend_over_pool_read(dtype: torch.dtype) -> None:
    """Against today's engine path: KVPool.write of the new token, KVPool.read of the visible
    keys, fp32 copy, `attend` (32 query heads over 4 KV heads, window and sinks as GPT-OSS)."""
    g = torch.Generator().manual_seed(11)
    pool = KVPool(2, 64, PAGE, 4, 128, dtype)
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    pages = torch.randperm(64, generator=g)[:40].tolist()
    for ctx, window, sinks in [(0, None, None), (259, None, None), (259, 64, torch.randn(32))]:
        q = torch.randn(1, 32, 128, generator=g)
        k, v = torch.randn(2, 1, 4, 128, generator=g)
        pool.write(1, pages, ctx, k, v)
        first = 0 if window is None else max(0, ctx - window + 1)
        kc, vc = pool.read(1, pages, ctx + 1, start=first)
        want = attend(q, kc.float(), vc.float(), ctx - first, 128**-0.5, window, sinks)
        got = dense_native.decode_attention(
            q,
            pool.k[1],
            pool.v[1],
            torch.tensor([pages]),
            torch.tensor([ctx + 1]),
            128**-0.5,
            window,
            sinks,
        )
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
