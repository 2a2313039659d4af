"""Native prefill attention over the paged KV pool (`ftdense`, native/dense/prefill_attention.h):
against a plain-torch reference on every ISA path, batch invariance bit for bit, and the models'
greedy tokens and logits against the torch prefill path.

Tolerance against the reference: both sides compute in fp32 from the same stored K/V (bf16
pages widen exactly); they differ in summation order, in the kernel's scaling of q before the
dot products (one rounding) and in its exp (within 2 ulp of expf). Outputs are convex
combinations of V entries of order 1, so differences stay ~1e-6; rtol = atol = 2e-5. A wrong
page, row, head, mask or a missing key moves an output by >= ~1e-3. The bf16-dot kernels
("avx512bf16", "emubf16") on a bf16 pool round q and the weights to bf16: against this fp32
reference within BF16_DOT_TOL (seen ~5e-3); test_prefill_attention_bf16dot.py holds them to a
reference with their roundings. Their bit-for-bit checks here (chunking, tiles, few rows) are
the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from greedy_check import assert_greedy_agrees
from native_isa import force_isa
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.models.layers import attention as attn
from freetokend.native import dense_native

pytestmark = pytest.mark.skipif(
    not dense_native.available(), reason="ftdense extension not built (pip install -e .)"
)

RTOL = ATOL = 2e-5
BF16_DOT_TOL = 3e-2
PAGE = 16
# Forced ISA -> the prefill kernel it selects; ISAs this CPU lacks are skipped ("emu512" runs
# the AVX-512 kernel's arithmetic on any CPU, "emubf16" the avx512bf16 one's).
ISAS = {
    "avx512": "avx512",
    "avx2": "avx2",
    "scalar": "scalar",
    "emu512": "emu512",
    "avx512bf16": "avx512bf16",
    "emubf16": "emubf16",
}
BF16_DOT = ("avx512bf16", "emubf16")


def _tol(isa: str, dtype: torch.dtype) -> float:
    """The tolerance against the fp32 / float64 references (module docstring)."""
    return BF16_DOT_TOL if isa in BF16_DOT and dtype == torch.bfloat16 else RTOL


@pytest.fixture(autouse=True)
def _restore_pool() -> Iterator[None]:
    yield
    dense_native.configure(2)
    dense_native.prefill_small_rows(None)


def _use(isa: str, threads: int = 2) -> None:
    """Forces `isa` (skips the test if this CPU lacks it)."""
    force_isa(isa, threads, dense_native.prefill_isa, ISAS[isa])


class Case:
    """Random pages holding sequences of `lens` tokens (scattered page tables), and q rows for
    every position of every sequence (sequence i's rows in order, after the earlier ones)."""

    def __init__(
        self, heads: int, kv_heads: int, d: int, lens: list[int], dtype: torch.dtype, seed: int
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        width = max(-(-n // PAGE) for n in lens)
        num_pages = width * len(lens) + 3
        self.k = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
        self.v = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
        perm = torch.randperm(num_pages, generator=g).int()
        self.tables = torch.stack([perm[i * width : (i + 1) * width] for i in range(len(lens))])
        self.lens = lens
        self.first = [sum(lens[:i]) for i in range(len(lens))]  # sequence i's first q row
        self.q = torch.randn(sum(lens), heads, d, generator=g)
        self.heads = heads

    def chunks(self, cuts: list[list[int]]) -> list[tuple[int, int, int]]:
        """(sequence, position, length) of every chunk when sequence i is cut at cuts[i]."""
        out = []
        for i, n in enumerate(self.lens):
            bounds = [0, *cuts[i], n]
            out += [(i, a, b - a) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
        return out

    def args(self, chunks: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
        seq = torch.tensor([c[0] for c in chunks])
        pos = torch.tensor([c[1] for c in chunks], dtype=torch.int32)
        rows = torch.tensor([self.first[c[0]] + c[1] for c in chunks], dtype=torch.int32)
        lens = torch.tensor([c[2] for c in chunks], dtype=torch.int32)
        return self.q, self.k, self.v, self.tables[seq], rows, lens, pos

    def run(
        self, chunks: list[tuple[int, int, int]], window: int | None = None,
        sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        scale = self.q.shape[-1] ** -0.5
        return dense_native.prefill_attention(*self.args(chunks), scale, window, sinks, out)

    def reference(
        self, chunks: list[tuple[int, int, int]], window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        scale = self.q.shape[-1] ** -0.5
        return dense_native.prefill_attention_reference(*self.args(chunks), scale, window, sinks)


def test_forced_isa_picks_kernel() -> None:
    """Every ISA that can be forced selects its prefill kernel; at least scalar and emu512 run."""
    ran = 0
    for isa, kernel in ISAS.items():
        try:
            dense_native.configure(2, isa=isa)
        except ValueError:
            continue
        assert dense_native.prefill_isa() == kernel
        ran += 1
    assert ran >= 2


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize(
    "heads,kv_heads,d,dtype,window,sinks",
    [
        (8, 2, 64, torch.bfloat16, None, False),
        (4, 4, 128, torch.float32, None, False),
        (6, 2, 32, torch.bfloat16, 40, True),
        (2, 1, 256, torch.bfloat16, None, True),
        (4, 2, 16, torch.float32, 70, False),
    ],
    ids=str,
)
def test_matches_reference(
    isa: str, heads: int, kv_heads: int, d: int, dtype: torch.dtype, window: int | None,
    sinks: bool,
) -> None:  # fmt: skip
    """Chunks after cached contexts (inside a page, on a page boundary, on a key block
    boundary, none), of several lengths, in one call, against the torch reference."""
    _use(isa)
    case = Case(heads, kv_heads, d, [150, 37, 200, 70], dtype, seed=d + heads)
    chunks = [(0, 0, 150), (1, 5, 32), (2, 64, 136), (3, 16, 54)]
    sk = torch.randn(heads) * 2 if sinks else None
    got = case.run(chunks, window, sk, out=torch.zeros(case.q.shape))
    want = case.reference(chunks, window, sk)
    tol = _tol(isa, dtype)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_a_wrong_page_is_caught() -> None:
    """The kernel reads the table's pages: a table pointing elsewhere moves the output."""
    dense_native.configure(2)
    case = Case(8, 2, 64, [120], torch.bfloat16, seed=3)
    good = case.run([(0, 40, 80)])
    case.tables[0, 2] = case.tables[0, 2] + 1 if int(case.tables[0, 2]) == 0 else 0
    bad = case.run([(0, 40, 80)])
    assert (good[40:120] - bad[40:120]).abs().max() > 1e-3


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("window,sinks", [(None, False), (50, True)], ids=str)
def test_any_chunking_gives_the_same_bits(isa: str, window: int | None, sinks: bool) -> None:
    """A prompt prefilled whole, or cut anywhere (1-token chunks included), alone or beside
    other chunks, on 1 or 2 threads: every row's output is the same, bit for bit."""
    _use(isa)
    heads, kv_heads, d, n = 8, 2, 32, 300
    case = Case(heads, kv_heads, d, [n, 90], torch.bfloat16, seed=5)
    sk = torch.randn(heads) if sinks else None
    whole = case.run(case.chunks([[], []]), window, sk)
    g = torch.Generator().manual_seed(9)
    for threads in (2, 1):
        _use(isa, threads)
        for trial in range(3):
            cuts = sorted(set(torch.randint(1, n, (1 + 4 * trial,), generator=g).tolist()))
            cuts = [*cuts, cuts[-1] + 1] if cuts[-1] + 1 < n else cuts  # a 1-token chunk
            other = [sorted(set(torch.randint(1, 90, (trial,), generator=g).tolist()))]
            got = case.run(case.chunks([cuts, *other]), window, sk)
            assert torch.equal(got, whole), (threads, cuts)
            # each chunk in a call of its own
            alone = torch.empty_like(got)
            for ch in case.chunks([cuts, *other]):
                case.run([ch], window, sk, out=alone)
            assert torch.equal(alone, whole), (threads, cuts)


def _reference64(
    case: Case, n: int, window: int | None, sinks: torch.Tensor | None
) -> torch.Tensor:  # fmt: skip
    """Sequence 0's rows [0, n) in float64 from the same stored K/V (plain softmax)."""
    heads, kv_heads = case.heads, case.k.shape[2]
    kpos = torch.arange(n)
    page = case.tables[0].long()[kpos // PAGE]
    k = case.k[page, kpos % PAGE].double().repeat_interleave(heads // kv_heads, dim=1)
    v = case.v[page, kpos % PAGE].double().repeat_interleave(heads // kv_heads, dim=1)
    logits = torch.einsum("qhd,khd->hqk", case.q[:n].double(), k) * case.q.shape[-1] ** -0.5
    allowed = kpos.unsqueeze(0) <= kpos.unsqueeze(1)
    if window is not None:
        allowed &= kpos.unsqueeze(0) > kpos.unsqueeze(1) - window
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.double().view(heads, 1, 1).expand(heads, n, 1)], dim=2)
    probs = torch.softmax(logits, dim=2)[..., :n]
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize(
    "heads,kv_heads,d,dtype,window,sinks",
    [
        (4, 4, 32, torch.bfloat16, None, False),
        (8, 2, 64, torch.float32, None, True),
        (6, 2, 16, torch.bfloat16, 40, True),
        (8, 1, 32, torch.float32, 100, False),
    ],
    ids=str,
)
def test_few_row_chunks_keep_the_bits(
    isa: str, heads: int, kv_heads: int, d: int, dtype: torch.dtype, window: int | None,
    sinks: bool,
) -> None:  # fmt: skip
    """Chunks of 1 to 5 rows, through the few-row kernel (forced for tiles of up to 5 rows, and
    the automatic choice) at positions inside the first key block, on and across block boundaries
    and a few hundred keys in, give the bits of the same rows inside one whole chunk (the tile
    kernel); the whole agrees with a float64 reference."""
    _use(isa)
    n = 330
    case = Case(heads, kv_heads, d, [n], dtype, seed=d + 7 * heads + kv_heads)
    sk = torch.randn(heads) * 2 if sinks else None
    dense_native.prefill_small_rows(0)  # the tile kernel only
    whole = case.run([(0, 0, n)], window, sk)
    tol = _tol(isa, dtype)
    torch.testing.assert_close(whole, _reference64(case, n, window, sk).float(), rtol=tol, atol=tol)
    starts = [0, 2, 60, 62, 63, 64, 127, 128, 190, 250, 300, 325]
    for small in (5, None):
        dense_native.prefill_small_rows(small)
        for length in range(1, 6):
            for p in (p for p in starts if p + length <= n):
                got = case.run([(0, p, length)], window, sk, out=torch.zeros(case.q.shape))
                assert torch.equal(got[p : p + length], whole[p : p + length]), (small, p, length)


def test_vector_paths_give_the_same_bits() -> None:
    """Rows sit in the lanes and no operation mixes lanes: the AVX2 and AVX-512 kernels (and the
    emulation of the latter) give the same bits; the scalar one agrees within tolerance."""
    case = Case(8, 2, 64, [200, 77], torch.bfloat16, seed=8)
    chunks = case.chunks([[130], [40]])
    sk = torch.randn(8)
    outs = {}
    for isa in ISAS:
        try:
            dense_native.configure(2, isa=isa)
        except ValueError:
            continue
        outs[isa] = case.run(chunks, 60, sk)
    assert "emu512" in outs and "scalar" in outs
    for isa in ("avx2", "avx512"):
        if isa in outs:
            assert torch.equal(outs[isa], outs["emu512"]), isa
    torch.testing.assert_close(outs["scalar"], outs["emu512"], rtol=RTOL, atol=ATOL)


def test_refuses_bad_input() -> None:
    _use("scalar")
    case = Case(4, 2, 32, [40], torch.float32, seed=1)
    q, k, v, tables, rows, lens, pos = case.args([(0, 0, 40)])
    with pytest.raises(ValueError, match="page table"):
        dense_native.prefill_attention(q, k, v, tables[:, :1], rows, lens, pos, 1.0)
    with pytest.raises(ValueError, match="rows"):
        dense_native.prefill_attention(q, k, v, tables, rows + 1, lens, pos, 1.0)
    with pytest.raises(ValueError, match="share"):
        two = torch.tensor([0, 10], dtype=torch.int32)
        dense_native.prefill_attention(
            q, k, v, tables.repeat(2, 1), two, torch.tensor([20, 20], dtype=torch.int32),
            torch.tensor([0, 0], dtype=torch.int32), 1.0,
        )  # fmt: skip
    bad = tables.clone()
    bad[0, 1] = 10_000
    with pytest.raises(ValueError, match="outside the pool"):
        dense_native.prefill_attention(q, k, v, bad, rows, lens, pos, 1.0)
    assert not dense_native.prefill_usable(torch.zeros(1, 4, 24), torch.zeros(2, 16, 2, 24),
                                           torch.zeros(2, 16, 2, 24))  # fmt: skip


# ---- the models: native prefill against the torch path ---------------------------------------

NEW_TOKENS = 6
# fp32 checkpoints (fp32 KV pool): the two paths' logits part by ~1.5e-6 (measured). With bf16
# ones the attention outputs mostly round to the same bf16 inputs of o_proj, but where one
# crosses a rounding boundary a random tiny model can flip a routing choice downstream (one
# row's logits moved by 0.39 in a measured case): fp32 keeps the comparison tight.
LOGIT_ATOL = 1e-4
NEAR_TIE = 1e-3


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp(f"{request.param}-prefill")
    make_tiny(request.param, d, seed=23, dtype=torch.float32)
    return d


def _llm(d: Path, step: int) -> LLM:
    return LLM(d, "cpu", max_model_len=256, kv_tokens=2048, prefix_cache=False,
               max_step_tokens=step)  # fmt: skip


def test_model_matches_the_torch_path(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens of prompts prefilled through the native kernel, whole or in chunks of 7,
    equal the torch path's up to a near-tie, and the teacher-forced logits agree within
    LOGIT_ATOL."""
    calls = []
    real = dense_native.prefill_attention
    monkeypatch.setattr(
        dense_native, "prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 97, (n,), generator=g).tolist() for n in (60, 23, 90)]
    monkeypatch.setattr(attn, "native_prefill", False)
    ref_llm = _llm(model_dir, 512)
    ref = ref_llm.generate(prompts, NEW_TOKENS, ignore_eos=True)
    ref_logits = [ref_llm.logits(p + r) for p, r in zip(prompts, ref, strict=True)]
    assert not calls
    monkeypatch.setattr(attn, "native_prefill", True)
    llm = _llm(model_dir, 512)
    got = llm.generate(prompts, NEW_TOKENS, ignore_eos=True)
    assert calls
    assert_greedy_agrees(got, ref, prompts, ref_llm, margin=NEAR_TIE)
    for p, r, want in zip(prompts, ref, ref_logits, strict=True):
        torch.testing.assert_close(llm.logits(p + r), want, rtol=0, atol=LOGIT_ATOL)
    chunked = _llm(model_dir, 7).generate(prompts, NEW_TOKENS, ignore_eos=True)
    assert_greedy_agrees(chunked, ref, prompts, ref_llm, margin=NEAR_TIE)
