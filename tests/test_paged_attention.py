"""The paged decode attention kernel (kernels/paged_attention.py) against its torch reference, and
the reference against the model's torch attention path on the same pool data.

The kernel runs in the Triton interpreter on CPU tensors (ftkernels.interp: nothing is set
process-wide, so TRITON_INTERPRET never leaks into other tests), or compiled on CUDA with
FT_TEST_ACCELERATOR=cuda (tests/gpu/check.sh).

Tolerance: both sides compute in fp32 from the same stored K/V (bf16 widens exactly), so fp32
outputs differ only in summation order (~1e-6); bf16 outputs by one rounding of the output
(2**-8 relative). A wrong page, row, head or key moves an output by >= ~1e-3.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from freetokend.kv.pool import KVPool
from freetokend.kv.seq_state import SeqState
from freetokend.models.batch import ForwardBatch, SeqChunk
from freetokend.models.layers import attention as attn
from freetokend.native import dense_native
from ftkernels import ops, paged_attention
from ftkernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    splits_for,
)

CUDA = os.environ.get("FT_TEST_ACCELERATOR") == "cuda"
DEV = "cuda" if CUDA else "cpu"


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 2e-5, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}


def _case(
    heads: int,
    kv_heads: int,
    d: int,
    page: int,
    lens: list[int],
    dtype: torch.dtype,
    sinks: bool,
    seed: int,
    extra_rows: int = 2,
) -> tuple[torch.Tensor, ...]:
    """Random pages, scattered page tables, queries in shuffled rows of a larger q."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // page) for n in lens)
    num_pages = width * len(lens) + 3
    kp = torch.randn(num_pages, page, kv_heads, d, generator=g).to(dtype)
    vp = torch.randn(num_pages, page, kv_heads, d, generator=g).to(dtype)
    # disjoint pages per sequence, in random order (a wrong table entry reads another sequence)
    perm = torch.randperm(num_pages, generator=g)
    tables = perm[: width * len(lens)].view(len(lens), width).int()
    rows = torch.randperm(len(lens) + extra_rows, generator=g)[: len(lens)].int()
    q = torch.randn(len(lens) + extra_rows, heads, d, generator=g).to(dtype)
    sk = torch.randn(heads, generator=g).mul(2).to(dtype) if sinks else None
    return q, kp, vp, tables, torch.tensor(lens, dtype=torch.int32), rows, sk


def _both(case: tuple[torch.Tensor | None, ...], window: int | None, max_len: int | None = None):  # type: ignore[no-untyped-def]
    q, kp, vp, tables, lens, rows, sk = case
    assert q is not None and lens is not None
    d = q.shape[2]
    ml = int(lens.max()) if max_len is None else max_len
    dev = [None if t is None else t.to(DEV) for t in case]
    got = paged_decode_attention(*dev[:6], ml, d**-0.5, window, dev[6]).cpu()  # type: ignore[arg-type]
    want = paged_decode_attention_reference(*case[:6], ml, d**-0.5, window, sk)  # type: ignore[arg-type]
    return got, want


@pytest.mark.parametrize(
    "heads,kv_heads,d,page,lens,window,sinks,dtype",
    [
        (4, 4, 32, 16, [1, 17, 40], None, False, torch.float32),  # MHA, page boundaries
        (8, 2, 64, 16, [5, 100, 33], None, True, torch.float32),  # GQA 4, sinks
        (16, 2, 64, 4, [70, 1, 9], 16, True, torch.float32),  # GQA 8, window, tiny pages
        (8, 1, 32, 1, [12, 3], 5, False, torch.float32),  # one KV head, page size 1
        (6, 2, 48, 16, [31, 64, 65], 200, False, torch.float32),  # G = 3, d 48: padded
        (8, 4, 128, 16, [90, 2, 47], 32, True, torch.bfloat16),  # bf16 pages and q
    ],
)
def test_kernel_matches_reference(
    heads: int,
    kv_heads: int,
    d: int,
    page: int,
    lens: list[int],
    window: int | None,
    sinks: bool,
    dtype: torch.dtype,
) -> None:
    case = _case(heads, kv_heads, d, page, lens, dtype, sinks, seed=heads + page + len(lens))
    got, want = _both(case, window)
    assert got.dtype == dtype and got.shape == (len(lens), heads, d)
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


def test_many_splits_and_empty_ones() -> None:
    """One long context over more splits than the reduce kernel merges per step (16), beside a
    one-key sequence whose later splits are empty; max_len above every length."""
    lens = [1300, 1, 700]
    splits, part = splits_for(len(lens), 1, 1400, 32)
    assert splits > paged_attention.SPLIT_BLOCK and part * splits >= 1400
    case = _case(4, 1, 32, 16, lens, torch.float32, True, seed=7)
    got, want = _both(case, None, max_len=1400)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_kernel_detects_a_wrong_page() -> None:
    """The tolerance is tight enough to see one swapped page (the test can fail)."""
    q, kp, vp, tables, lens, rows, sk = _case(8, 2, 64, 16, [40, 40], torch.float32, False, 3)
    got, _ = _both((q, kp, vp, tables, lens, rows, sk), None)
    bad = tables.clone()
    bad[0, 1] = tables[1, 1]
    want = paged_decode_attention_reference(q, kp, vp, bad, lens, rows, 40, 64**-0.5)
    assert (got - want).abs().max() > 1e-3


def test_split_counts() -> None:
    # batch 1, Qwen3-30B-A3B, 32k context: the 4 KV heads alone are 4 programs; split to ~1024
    assert splits_for(1, 4, 32768, 128)[0] == 256
    # batch 64 fills the card by itself: 4 splits
    assert splits_for(64, 4, 32768, 128)[0] == 4
    # a context of one block is never split; two blocks at batch 1 are
    bn = paged_attention.block_n(64)
    assert splits_for(1, 8, bn, 64) == (1, bn)
    assert splits_for(1, 8, bn + 1, 64) == (2, bn)


def test_bad_shapes_are_refused() -> None:
    q, kp, vp, tables, lens, rows, sk = _case(6, 4, 32, 16, [3], torch.float32, False, 1)
    with pytest.raises(ValueError, match="KV heads"):
        paged_decode_attention_reference(q, kp, vp, tables, lens, rows, 3, 1.0)
    q, kp, vp, tables, lens, rows, _ = _case(8, 2, 32, 16, [3], torch.float32, False, 1)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention_reference(q, kp, vp, tables, lens, rows, 3, 1.0, None,
                                         torch.zeros(4))  # fmt: skip


# -- tied to what the model computes ---------------------------------------------------------


@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The model's attention without the native CPU decode kernel: the path a device takes."""
    monkeypatch.setattr(dense_native, "attention_usable", lambda *a: False)
    yield


@pytest.fixture
def kernel_knob(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The knob on, and the kernel allowed on CPU tensors (it runs in the interpreter)."""
    monkeypatch.setattr(attn, "_KERNEL_DEVICES", ("cuda", "cpu"))
    old = attn.set_decode_kernel("triton")
    yield
    attn.set_decode_kernel(old)


def _pool_batch(
    lens: list[int], prefill: int, heads: int, kv_heads: int, d: int, page: int, seed: int
) -> tuple[ForwardBatch, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A pool holding each decode sequence's context (lens - 1 tokens, written in scattered
    pages), a batch of one decode row per sequence after an optional prefill chunk, q and the
    rows' new K/V."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(1, 64, page, kv_heads, d)
    pool.alloc(5)  # the sequences' pages start past a few held ones
    chunks, row = [], 0
    if prefill:
        st = SeqState(pages=pool.alloc(pool.pages_for(prefill)))
        chunks.append(SeqChunk(row, prefill, 0, st))
        row += prefill
    for n in lens:
        st = SeqState(pages=pool.alloc(pool.pages_for(n))[::-1], num_tokens=n - 1)
        ctx = n - 1
        pool.write(0, st.pages, 0, torch.randn(ctx, kv_heads, d, generator=g),
                   torch.randn(ctx, kv_heads, d, generator=g))  # fmt: skip
        chunks.append(SeqChunk(row, 1, ctx, st))
        row += 1
    batch = ForwardBatch(
        token_ids=torch.zeros(row, dtype=torch.long),
        positions=torch.zeros(row, dtype=torch.long),
        chunks=chunks,
        kv=pool,
        moe=None,  # type: ignore[arg-type]
        logits_rows=torch.zeros(0, dtype=torch.long),
    )
    q = torch.randn(row, heads, d, generator=g)
    kv = (torch.randn(row, kv_heads, d, generator=g), torch.randn(row, kv_heads, d, generator=g))
    return batch, q, kv


def _reference_on_pool(
    batch: ForwardBatch,
    q: torch.Tensor,
    lens: list[int],
    scale: float,
    window: int | None,
    sk: torch.Tensor | None,
) -> torch.Tensor:
    """The reference on a decode-only batch's pool pages (the rows' K/V already written)."""
    width = max(batch.kv.pages_for(n) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, ch in enumerate(batch.chunks):
        tables[i, : len(ch.state.pages)] = torch.tensor(ch.state.pages)
    return paged_decode_attention_reference(
        q, batch.kv.k[0], batch.kv.v[0], tables, torch.tensor(lens, dtype=torch.int32),
        torch.arange(len(lens), dtype=torch.int32), max(lens), scale, window, sk,
    )  # fmt: skip


@pytest.mark.parametrize(
    "window,sinks", [(None, False), (None, True), (8, True), (100, False)], ids=str
)
def test_reference_matches_the_model_attention(
    no_native: None, window: int | None, sinks: bool
) -> None:
    """The reference on the pool's pages equals `attention.paged_attention` (torch path), decode
    rows only: the reference says what the model computes."""
    heads, kvh, d, lens = 8, 2, 32, [1, 20, 45, 9]
    batch, q, kv = _pool_batch(lens, 0, heads, kvh, d, 16, seed=11)
    sk = torch.randn(heads) if sinks else None
    want = attn.paged_attention(batch, 0, q, kv, d**-0.5, window, sk)
    got = _reference_on_pool(batch, q, lens, d**-0.5, window, sk)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("prefill", [0, 5])
def test_knob_routes_decode_rows_through_the_kernel(
    no_native: None, kernel_knob: None, monkeypatch: pytest.MonkeyPatch, prefill: int
) -> None:
    """With the knob on, decode rows go through the custom op (one call per layer for the whole
    batch) and give what the torch path gives; a prefill chunk beside them keeps the torch
    path."""
    heads, kvh, d, lens = 8, 2, 32, [30, 1, 17]
    batch, q, kv = _pool_batch(lens, prefill, heads, kvh, d, 16, seed=5 + prefill)
    calls = []
    real = ops.paged_decode_attention

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(args[5].tolist())
        return real(*args)

    monkeypatch.setattr(ops, "paged_decode_attention", counting)
    sk = torch.randn(heads)
    got = attn.paged_attention(batch, 0, q, kv, d**-0.5, 8, sk)
    assert calls == [list(range(prefill, prefill + len(lens)))]
    attn.set_decode_kernel("torch")
    batch.derived.clear()
    want = attn.paged_attention(batch, 0, q, None, d**-0.5, 8, sk)  # K/V already written
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_knob_refuses_unknown_names() -> None:
    """A refused name leaves the knob as the environment set it: its variable when given
    (tests/gpu/check.sh runs with triton), else torch, the default until a GPU run verified the
    kernel."""
    with pytest.raises(ValueError, match="triton"):
        attn.set_decode_kernel("flash")
    assert attn.decode_kernel() == (os.environ.get(attn.DECODE_KERNEL_ENV) or "torch")


def test_knob_leaves_host_tensors_to_the_torch_path(
    no_native: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the host (the cpu backend) the knob changes nothing: no interpreted kernel there,
    and the torch path's output (the reference's)."""
    lens = [12, 3]
    batch, q, kv = _pool_batch(lens, 0, 4, 2, 16, 16, seed=2)
    monkeypatch.setattr(ops, "paged_decode_attention", None)  # a call would fail
    old = attn.set_decode_kernel("triton")
    try:
        got = attn.paged_attention(batch, 0, q, kv, 0.25, None)
    finally:
        attn.set_decode_kernel(old)
    want = _reference_on_pool(batch, q, lens, 0.25, None, None)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_fake_impl_on_the_fake_device() -> None:
    """Under FakeTensorMode (the fake CUDA tier) the op's fake implementation gives the output
    shape and dtype on the device and launches nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        dev = torch.device("cuda")
        q = torch.empty(6, 64, 64, dtype=torch.bfloat16, device=dev)
        kp = torch.empty(100, 16, 8, 64, dtype=torch.bfloat16, device=dev)
        tables = torch.empty(4, 7, dtype=torch.int32, device=dev)
        lens = torch.empty(4, dtype=torch.int32, device=dev)
        sinks = torch.empty(64, dtype=torch.bfloat16, device=dev)
        out = ops.paged_decode_attention(q, kp, kp, tables, lens, lens, 100, 0.125, 128, sinks)
        assert out.shape == (4, 64, 64) and out.dtype == torch.bfloat16
        assert out.device.type == "cuda"
        with pytest.raises(RuntimeError, match="different devices"):
            ops.paged_decode_attention(q, kp, kp, tables.cpu(), lens, lens, 100, 0.1, None, None)
    assert mode is not None


# -- the fake CUDA tier ---------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fake_cuda_engine_decodes_through_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """The knob on the fake card: every attention layer of a decode step calls the op (its fake
    impl), the step still reads the host once and makes no blocking host -> device copy; the
    kernel's lens and page tables cross with the step's other metadata, in one asynchronous
    copy (engine/graphs.py)."""
    from tiny_models import make_tiny

    from freetokend import LLM
    from freetokend.engine.sampler import SamplingParams

    make_tiny(family, tmp_path, seed=3)
    calls: list[int] = []
    real = ops.paged_decode_attention

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(args[4].shape[0])
        return real(*args)

    monkeypatch.setattr(ops, "paged_decode_attention", counting)
    old = attn.set_decode_kernel("triton")
    llm = LLM(tmp_path, "fused", accelerator="fake-cuda", vram_mib=1024, kv_tokens=512)
    try:
        tr = llm.fake_device.tracker
        llm.engine.add_request(
            "a", list(range(3, 43)), SamplingParams(max_tokens=4, ignore_eos=True)
        )
        llm.engine.add_request(
            "b", list(range(5, 20)), SamplingParams(max_tokens=4, ignore_eos=True)
        )
        llm.engine.step()  # the prompts: no decode row, no kernel
        assert calls == []
        layers = sum(isinstance(m, attn.Attention) for m in llm.model.modules())
        assert layers > 0
        for _ in range(2):
            before, async_before = Counter(tr.syncs.by_kind), tr.async_h2d
            llm.engine.step()
            assert Counter(tr.syncs.by_kind) - before == Counter(d2h=1)
            # one: the static decode form's metadata holds the kernel's lens and page tables
            assert tr.async_h2d - async_before == 1
        assert calls == [2] * (2 * layers)
    finally:
        llm.close()
        attn.set_decode_kernel(old)


def test_daemon_setting_names_the_same_kernels() -> None:
    from freetokend.config import ATTENTION_KERNELS, ConfigError, DaemonConfig

    assert ATTENTION_KERNELS == attn.DECODE_KERNELS
    assert DaemonConfig().attention_kernel == "torch"
    DaemonConfig(attention_kernel="triton").check()
    with pytest.raises(ConfigError, match="attention_kernel"):
        DaemonConfig(attention_kernel="flash").check()


def test_the_daemon_applies_its_setting_when_it_loads_a_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from types import SimpleNamespace

    import freetokend.manager.control as control_mod
    from freetokend.config import DaemonConfig
    from freetokend.manager.control import ControlPlane

    seen: list[str] = []
    monkeypatch.setattr(control_mod, "LLM", lambda *a, **kw: seen.append(attn.decode_kernel()))
    plane = SimpleNamespace(
        cfg=DaemonConfig(attention_kernel="triton"), state_dir=tmp_path,
        _quantize=lambda p: None, _preset=lambda p: None, _bandwidth=lambda p, q: None,
        manager=SimpleNamespace(host_budget=1 << 50),  # the disk tier's budget: never short
    )  # fmt: skip
    old = attn.decode_kernel()
    try:
        ControlPlane._load_llm(plane, tmp_path, "m", "fused")  # type: ignore[arg-type]
        assert seen == ["triton"]
    finally:
        attn.set_decode_kernel(old)
