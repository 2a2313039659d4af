"""Decode attention's work buffers at the longest context, on the fake CUDA card (ARCHITECTURE §9.2).

The torch decode attention (``attention.masked_decode``) gathers its rows' keys and values into
fp32 buffers. Gathered whole at batch 8 over a long context they took gigabytes per layer, more
than the slot budget kept free: with ``cuda_graphs`` the capture of the widest bucket ran out of
memory at load and dropped every graph. Here the graphs of every bucket up to the widest table
are captured on a simulated card (the capture injected: the fake device runs no torch.cuda
graphs; each capture runs the step once, as a real one does) with the slots sized by the budget,
and the step's peak must stay within what the budget kept back for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine import graphs as g

# 8 KV heads of dim 64 (GPT-OSS's attention) over 32768 keys: 192 MiB of bf16 KV, 3 layers
KV_HEADS, HEAD_DIM, HEADS = 8, 64, 16
CONTEXT = 32768
VRAM_MIB = 1280  # 768 MiB usable: K/V of 8 rows gathered whole in fp32 (2 GiB) do not fit


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("decode-workspace")
    make_tiny(
        "qwen3_moe", d, seed=2, num_key_value_heads=KV_HEADS, num_attention_heads=HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=CONTEXT, dtype=torch.bfloat16,
    )  # fmt: skip
    return d


def _capture_once(fn):  # type: ignore[no-untyped-def]
    """A capture stand-in: the step run once, as a capture's warmup and recording run it."""
    return g.Captured(fn, fn())


def test_widest_graph_at_the_longest_context_fits_the_budget(long_dir: Path) -> None:
    llm = LLM(long_dir, "offload", accelerator="fake-cuda", vram_mib=VRAM_MIB, kv_tokens=CONTEXT)
    try:
        assert llm.max_model_len == CONTEXT
        tr = llm.fake_device.tracker
        with llm.fake_device.in_thread():
            # the widest batch bucket at every width up to the longest context's (the others are
            # narrower: the same check, more time)
            graphs = g.DecodeGraphs(
                llm.runner, llm.runner.kv.pages_for(llm.max_model_len),
                batches=g.BATCH_BUCKETS[-1:], capture=_capture_once,
            )  # fmt: skip
            assert graphs.widths[-1] * llm.runner.kv.page_size >= CONTEXT - 16
            live = tr.sweep()
            tr.reset_peak()
            assert graphs.capture_all(), graphs.disabled  # every bucket, the widest included
            step = tr.peak - live
        assert tr.peak <= tr.capacity
        budget = llm.slot_budget
        print(
            f"\ndecode step at batch {graphs.batches[-1]} x {CONTEXT} keys: peak over the loaded "
            f"{step / 2**20:.1f} MiB; the budget keeps {budget.step_bytes / 2**20:.1f} MiB"
        )
        assert step <= budget.step_bytes, (step, budget)
    finally:
        llm.close()


def test_chunked_decode_equals_whole() -> None:
    """`masked_decode` over keys in chunks (a small workspace) equals it over all keys at once,
    with a window and sinks, rows of other lengths, a row that sees no key of a whole chunk and
    NaN in the pages past each row's keys."""
    from freetokend.models.layers.attention import decode_chunk_pages, masked_decode

    gen = torch.Generator().manual_seed(1)
    pages, ps, kvh, heads, d = 24, 4, 2, 6, 8
    kp = torch.randn(pages, ps, kvh, d, generator=gen)
    vp = torch.randn(pages, ps, kvh, d, generator=gen)
    kp[20:], vp[20:] = float("nan"), float("nan")  # never written
    tables = torch.tensor([[19] + [20] * 7, list(range(8)), list(range(8, 16))], dtype=torch.int32)
    lens = torch.tensor([1, 29, 32])
    q = torch.randn(3, heads, d, generator=gen)
    one_page = decode_chunk_pages(3, heads, kvh, d, ps, 4, workspace=1)
    three = decode_chunk_pages(3, heads, kvh, d, ps, 4, workspace=13_000)
    assert (one_page, three) == (1, 3)  # at least a page; whole pages (8: 3, 3, 2)
    for window in (None, 5):
        for sinks in (None, torch.randn(heads, generator=gen)):
            whole = masked_decode(q, kp, vp, tables, lens, 0.3, window, sinks)
            for ws in (1, 13_000):
                got = masked_decode(q, kp, vp, tables, lens, 0.3, window, sinks, workspace=ws)
                assert not got.isnan().any()
                torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
