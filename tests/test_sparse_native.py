"""Native sparse decode attention and Lightning Indexer (`ftdense`, native/dense/sparse_attention.h,
daemon/native/sparse_native.py) against plain-torch references, on every ISA path this CPU runs.

The indexer's reference is the layers' own: `compressed.select_topk` over
sum_h w[h] * relu(scale * q[h] . k). Tolerance: both sides compute in fp32 from the same stored
keys (bf16 widens exactly) and differ only in summation order: ~1e-6 on scores of order 1, so
rtol = atol = 2e-5; the selections are compared exactly (random scores: the k-th and (k+1)-th
differ by far more than that). The attention's outputs are convex combinations of values of order
1 (the native exp is within 2 ulp of expf): rtol = atol = 2e-5; one row missed or read from a
wrong page moves them by ~1e-3.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from freetokend.experts.cpu_executor import supported_isas
from freetokend.models.layers.compressed import select_topk
from freetokend.native import dense_native, sparse_native
from freetokend.native.sparse_native import Rows, Segment
from freetokend.runtime import cpu_isa

pytestmark = pytest.mark.skipif(
    not dense_native.available(), reason="ftdense extension not built (pip install -e .)"
)

TOL = 2e-5
PAGE = 16
# Forced ISA -> the sparse attention kernel it selects (AVX-512 machines run the AVX2 one, as
# decode attention does; "emu512" the scalar one) and the indexer kernel (each ISA its own). A
# path this CPU cannot run is skipped with the reason.
ISAS = {"scalar": "scalar", "avx2": "avx2", "avx512": "avx2", "emu512": "scalar"}
INDEX_ISAS = {"scalar": "scalar", "avx2": "avx2", "avx512": "avx512", "emu512": "emu512"}


@pytest.fixture(autouse=True)
def _restore_pool() -> Iterator[None]:
    yield
    dense_native.configure(2)


@pytest.fixture(params=list(ISAS))
def isa(request) -> str:
    try:
        dense_native.configure(2, isa=request.param)
    except ValueError as e:
        pytest.skip(f"this CPU cannot run the {request.param} path: {e}")
    assert sparse_native.isa() == ISAS[request.param]
    assert sparse_native.index_isa() == INDEX_ISAS[request.param]
    return str(request.param)


def _paged(n: int, width: int, dtype: torch.dtype, g: torch.Generator):
    """A pool layer of scattered pages holding positions [0, n): (pages, table, rows [n, width]
    in position order, fp32)."""
    num_pages = -(-n // PAGE) + 5
    pages = torch.randn(num_pages, PAGE, 1, width, generator=g).to(dtype)
    table = torch.randperm(num_pages, generator=g)[: -(-n // PAGE)].int()
    pos = torch.arange(n)
    return pages, table, pages[table.long()[pos // PAGE], pos % PAGE, 0].float()


def _index_reference(q, w, keys, scale, k):
    scores = (torch.relu(torch.einsum("hd,nd->hn", q, keys) * scale) * w[:, None]).sum(0)
    return select_topk(scores[None], k)[0], scores


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("heads", "dim", "n", "k"), [(8, 64, 3000, 256), (3, 20, 40, 50), (32, 128, 700, 64)]
)
def test_indexer_matches_the_reference(isa, dtype, heads, dim, n, k):
    """Paged keys from a column offset (the DSA pool row's index key), several scoring tasks
    (3000 keys), head counts off the register tiles' head blocks, a dim off 8 (the packing's
    one-element path), GLM-5's 32 x 128, and k above n (every position, sorted)."""
    g = torch.Generator().manual_seed(heads)
    col = 9
    pages, table, rows = _paged(n, col + dim + 3, dtype, g)
    q, w = torch.randn(heads, dim, generator=g), torch.randn(heads, generator=g)
    sel, scores = sparse_native.index_topk(q, w, Rows(pages, col, table), n, k, dim**-0.5)
    want_sel, want = _index_reference(q, w, rows[:, col : col + dim], dim**-0.5, k)
    torch.testing.assert_close(scores, want, rtol=TOL, atol=TOL)
    assert torch.equal(sel, want_sel)


def test_indexer_over_contiguous_fp32_keys(isa):
    """DeepSeek-V4's entries: a contiguous [E, dim] fp32 tensor, only the first n visible."""
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(700, 32, generator=g)
    q, w = torch.randn(16, 32, generator=g), torch.randn(16, generator=g)
    sel, _ = sparse_native.index_topk(q, w, Rows(keys), 650, 64, 0.2)
    assert torch.equal(sel, _index_reference(q, w, keys[:650], 0.2, 64)[0])


def test_indexer_scores_are_the_same_bits_on_every_path_and_thread_count():
    """Each key's score is one fixed chain of fused multiply-adds in its own lane
    (native/dense/index_impl.h): every ISA path this CPU runs (AVX-512 emulated where it lacks
    it), with 1 or 2 threads (one scoring task or several), gives the same bits, on shapes off
    every register tile (13 heads, dim 20 and 128, keys not a multiple of a tile) and on
    DeepSeek-V4's fp32 entries and a bf16 pool alike."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for heads, dim, n, dtype in [(13, 20, 1001, torch.float32), (32, 128, 2333, torch.bfloat16)]:
        pages, table, _ = _paged(n, dim + 4, dtype, g)
        q, w = torch.randn(heads, dim, generator=g), torch.randn(heads, generator=g)
        cases.append((q, w, Rows(pages, 2, table), n))
    results = {}
    for isa in INDEX_ISAS:
        for threads in (1, 2):
            try:
                dense_native.configure(threads, isa=isa)
            except ValueError:
                continue  # a path this CPU cannot run
            assert sparse_native.index_isa() == INDEX_ISAS[isa]
            results[isa, threads] = [
                sparse_native.index_topk(q, w, rows, n, 64, dim**-0.5) for q, w, rows, n in cases
            ]
    assert {"scalar", "emu512"} <= {isa for isa, _ in results}
    first = next(iter(results.values()))
    for key, got in results.items():
        for (sel, scores), (sel0, scores0) in zip(got, first, strict=True):
            assert torch.equal(scores, scores0), key
            assert torch.equal(sel, sel0), key


@pytest.mark.parametrize("n", [60, 2500])
def test_indexer_ties_go_to_the_lowest_position(isa, n):
    """Constructed ties: three copies of the best key at scattered positions, then keys that
    score exactly 0 (every head's dot product negative): the copies come first in position
    order, then the zero-scored keys from the lowest position on, whatever the key count (2500:
    several scoring tasks)."""
    g = torch.Generator().manual_seed(2)
    heads, dim = 4, 16
    q = torch.rand(heads, dim, generator=g) + 0.1  # all positive
    w = torch.rand(heads, generator=g) + 0.1
    keys = -torch.rand(n, dim, generator=g) - 0.1  # all negative: score 0 exactly
    good = torch.tensor([n - 5, n // 2, 7])
    keys[good] = torch.rand(dim, generator=g) + 0.5  # one key, three times
    mid = torch.tensor([n - 9, 3])
    keys[mid] = torch.full((dim,), 0.05)  # a smaller positive score, twice
    pages = keys.bfloat16().view(-1, 1, 1, dim)  # page size 1
    table = torch.arange(n, dtype=torch.int32)
    sel, scores = sparse_native.index_topk(q, w, Rows(pages, 0, table), n, 9, 0.5)
    assert scores[good].unique().numel() == 1 and (scores == 0).sum() == n - 5
    zeros = [p for p in range(n) if p not in (*good.tolist(), *mid.tolist())][:4]
    assert sel.tolist() == [7, n // 2, n - 5, 3, n - 9, *zeros]


def _attention_reference(q, keys, dv, scale, sinks):
    logits = q @ keys.T * scale
    if sinks is not None:
        logits = torch.cat([logits, sinks[:, None]], dim=1)
    probs = torch.softmax(logits, dim=1)[:, : keys.shape[0]]
    return probs @ keys[:, :dv]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "dk", "dv"), [(12, 72, 64), (16, 64, 64), (5, 20, 12)])
@pytest.mark.parametrize("sinks", [False, True])
def test_sparse_attention_matches_the_reference(isa, dtype, heads, dk, dv, sinks):
    """Selected positions of a paged layer from a column offset plus a contiguous run of
    another tensor's rows (V4: the window's keys and the chosen entries); keys dk columns,
    values the first dv (MLA's absorbed latent); 700 rows: split over tasks and merged."""
    g = torch.Generator().manual_seed(heads + dk)
    col = 3
    pages, table, rows = _paged(900, col + dk, dtype, g)
    chosen = torch.randperm(900, generator=g)[:650]
    window = torch.randn(60, dk + 5, generator=g).to(dtype)
    q = torch.randn(heads, dk, generator=g)
    sk = torch.randn(heads, generator=g) if sinks else None
    out = sparse_native.sparse_attention(
        q,
        [Segment(Rows(pages, col, table), chosen), Segment(Rows(window), None, 10, 50)],
        dv, dk**-0.5, sk,
    )  # fmt: skip
    keys = torch.cat([rows[chosen, col:], window[10:60, :dk].float()])
    torch.testing.assert_close(
        out, _attention_reference(q, keys, dv, dk**-0.5, sk), rtol=TOL, atol=TOL
    )


def test_one_row_and_bad_input(isa):
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(4, 16, generator=g)
    q = torch.randn(2, 16, generator=g)
    out = sparse_native.sparse_attention(q, [Segment(Rows(rows), torch.tensor([2]))], 16, 1.0)
    torch.testing.assert_close(out, rows[2].expand(2, 16))
    with pytest.raises(ValueError, match="outside the rows"):
        sparse_native.sparse_attention(q, [Segment(Rows(rows), torch.tensor([4]))], 16, 1.0)
    with pytest.raises(ValueError, match="bf16 or all fp32"):
        sparse_native.sparse_attention(
            q, [Segment(Rows(rows), None, 0, 2), Segment(Rows(rows.bfloat16()), None, 0, 2)],
            16, 1.0,
        )  # fmt: skip
    pages = rows.view(2, 2, 1, 16)
    with pytest.raises(ValueError, match="past its page table"):
        sparse_native.index_topk(
            q, torch.ones(2), Rows(pages, 0, torch.tensor([1], dtype=torch.int32)), 3, 2, 1.0
        )


@pytest.mark.parametrize("value", ["scalar", "avx2", "avx512"])
def test_the_forced_path_selects_the_sparse_kernels(value, monkeypatch):
    """FREETOKEN_CPU_ISA (runtime/cpu_isa.py) reaches these kernels through the pool's
    configuration, as it does decode attention's: "avx512" where the CPU lacks it is emulated
    (emu512), which runs the scalar ones."""
    if value not in supported_isas() and value not in ("scalar", "avx512"):
        pytest.skip(f"this CPU has no {value}")
    monkeypatch.setenv(cpu_isa.ENV, value)
    dense_native.configure(1)
    want = cpu_isa.forced(supported_isas(), {cpu_isa.ENV: value})
    assert sparse_native.isa() == ISAS[str(want)]
    assert sparse_native.index_isa() == INDEX_ISAS[str(want)]
