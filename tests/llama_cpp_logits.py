"""llama.cpp's teacher-forced logits through llama-cpp-python, and the comparison the opt-in
llama.cpp tests make (test_gguf_llamacpp_slow.py, test_gguf_llamacpp_convert_slow.py)."""

from __future__ import annotations

from pathlib import Path

import torch


def llama_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32 from llama.cpp with an F32 KV cache (its default F16 cache alone
    moves logits by ~1e-3), 2 threads."""
    # deferred: llama_cpp (optional; the tests that call this import-skip without it)
    import llama_cpp

    m = llama_cpp.Llama(
        str(path),
        n_ctx=128,
        n_batch=128,
        n_threads=2,
        logits_all=True,
        verbose=False,
        type_k=0,  # GGML_TYPE_F32
        type_v=0,
    )
    m.eval(ids)
    return torch.tensor(m.scores[: len(ids)], dtype=torch.float32)


def compare(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(top-1 agreement, max |diff|, median over positions of the per-position max |diff|)."""
    per_pos = (ours - ref).abs().amax(-1)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return agree, per_pos.max().item(), per_pos.median().item()
