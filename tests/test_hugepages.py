"""Weights collapsed into transparent huge pages after load (models/hugepages.py)."""

from __future__ import annotations

import torch

from freetokend.models import hugepages


def _huge_kb_in(lo: int, hi: int) -> int:
    """AnonHugePages (kB) of this process's mappings overlapping [lo, hi) (Linux smaps; the
    madvised range may be split into several mappings)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a < hi and lo < b
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_collapse_keeps_the_data_and_maps_huge_pages() -> None:
    w = torch.randn(6 << 20)  # 24 MiB: at least 10 whole 2 MiB regions
    small = torch.randn(1000)
    want = w.clone()
    done = hugepages.back_with_huge_pages([w, w, small])  # the same storage twice: once
    assert torch.equal(w, want)
    start = -(-w.data_ptr() // (2 << 20)) * (2 << 20)
    whole = (w.data_ptr() + w.numel() * 4) // (2 << 20) * (2 << 20) - start
    assert done in (0, whole)  # 0: this kernel refuses (THP off, before Linux 6.1)
    if done:
        assert _huge_kb_in(start, start + whole) >= whole >> 10


def test_weight_tensors_cover_quantized_rows_and_banks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tiny_models import make_tiny

    from freetokend import LLM

    path, _ = make_tiny(
        "qwen3_moe", tmp_path, seed=2, dtype=torch.bfloat16, hidden_size=256, head_dim=64
    )
    llm = LLM(str(path), moe_backend="cpu", quantize="q8_0", max_model_len=64)
    found = {t.data_ptr() for t in hugepages.weight_tensors(llm.model, llm.banks)}
    assert llm.model.lm_head.qweight is not None
    assert llm.model.lm_head.qweight.raw.data_ptr() in found
    assert all(t.data_ptr() in found for t in llm.banks.all_tensors().values())


def test_advised_before_the_fill_gets_huge_pages_and_no_second_pass() -> None:
    """Inside advise_at_fill a new tensor is marked MADV_HUGEPAGE before it is written: its
    fill faults in huge pages, and back_with_huge_pages leaves it alone (no collapse pass)."""
    with hugepages.advise_at_fill():
        w = hugepages.advise_new(torch.empty(6 << 20))
    w.copy_(torch.arange(6 << 20, dtype=torch.float32))  # the fill
    outside = hugepages.advise_new(torch.empty(6 << 20))  # not inside: left alone
    assert (w.data_ptr(), w.numel() * 4) in hugepages._advised
    assert (outside.data_ptr(), outside.numel() * 4) not in hugepages._advised
    assert hugepages.back_with_huge_pages([w]) == 0  # skipped: nothing collapsed
    assert torch.equal(w, torch.arange(6 << 20, dtype=torch.float32))
    start = -(-w.data_ptr() // (2 << 20)) * (2 << 20)
    whole = (w.data_ptr() + w.numel() * 4) // (2 << 20) * (2 << 20) - start
    huge = _huge_kb_in(start, start + whole)
    assert huge in (0, whole >> 10) or huge >= (whole >> 10) // 2  # 0: THP off or refused
