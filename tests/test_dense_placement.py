"""The dense part on the accelerator (engine/placement.py), checked on the CPU stand-in.

With ``fused``, ``offload`` and ``hybrid`` the dense weights, KV pool and recurrent state live on
the accelerator's device and the forward runs the device code path: torch ops, never the native
host kernels of ``ftdense`` (counted here: a call fails the test). The ``cpu`` backend keeps the
host path (those kernels run). The outside oracle is the ``cpu`` backend, itself checked against
transformers in test_engine_families.py: greedy tokens identical for every tiny family up to a
near-tie (greedy_check.py), at one slot and at every expert resident, and logits within
``LOGIT_ATOL`` (fp32 checkpoints; the device path sums attention, norms and projections in
torch's order, the host kernels in theirs).
tests/gpu/check.sh runs this file on a real GPU (FT_TEST_ACCELERATOR=cuda).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_check import assert_greedy_agrees
from tiny_models import FAMILIES, VARIANTS, make_tiny

from freetokend import LLM
from freetokend.engine.placement import dense_device_bytes
from freetokend.native import dense_native

ACCEL = os.environ.get("FT_TEST_ACCELERATOR", "standin")
LOGIT_ATOL = 1e-4  # measured max 6.2e-6 (gemma4), most families ~1e-6 (fp32 weights)
PROMPTS_N = (13, 5)
MAX_TOKENS = 6


class _CountingNative:
    """Wraps the ``ftdense`` module: counts every call into it."""

    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.real, name)
        if not callable(attr) or name in ("configured", "configure"):
            return attr

        def counted(*a: Any, **k: Any) -> Any:
            self.calls += 1
            return attr(*a, **k)

        return counted


@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> _CountingNative:
    if not dense_native.available():
        pytest.skip("ftdense not built: nothing to tell the paths apart by")
    counter = _CountingNative(dense_native._native)
    monkeypatch.setattr(dense_native, "_native", counter)
    return counter


def _prompts(vocab: int = 97) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPTS_N]


def _llm(d: Path, backend: str, **kw: Any) -> LLM:
    return LLM(d, backend, max_model_len=128, kv_tokens=512, accelerator=ACCEL, **kw)


@pytest.mark.parametrize("family", FAMILIES + tuple(VARIANTS))
def test_device_path_matches_cpu_at_one_slot_and_all(
    family: str, tmp_path: Path, native_calls: _CountingNative
) -> None:
    make_tiny(family, tmp_path, seed=13)
    prompts = _prompts()
    cpu = _llm(tmp_path, "cpu")
    ref = cpu.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref_logits = cpu.logits(prompts[0])
    assert native_calls.calls > 0  # the host path runs the native kernels
    assert not cpu.runner.placement.on_device
    total = cpu.banks.num_flat
    runs: list[tuple[str, dict[str, int]]] = [("fused", {})] + [
        (be, {"moe_slots": n}) for be in ("offload", "hybrid") for n in sorted({1, total})
    ]
    for backend, kw in runs:
        llm = _llm(tmp_path, backend, **kw)
        assert llm.runner.placement.on_device, backend
        native_calls.calls = 0
        out = llm.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
        logits = llm.logits(prompts[0])
        assert native_calls.calls == 0, f"{backend}: the device path called ftdense"
        assert_greedy_agrees(out, ref, prompts, cpu, what=(family, backend, kw))
        err = (logits - ref_logits).abs().max().item()
        assert err < LOGIT_ATOL, (family, backend, kw, err)


def test_seeded_sampling_on_the_device_draws_the_host_tokens(tmp_path: Path) -> None:
    """Temperature, top-k, top-p and min-p with a seed: the stand-in's device generators give
    the host's draws (the same generator type and the same noise per row). A CUDA generator
    draws other numbers than the host's: there, a seed gives the same tokens twice."""
    make_tiny("qwen3_moe", tmp_path, seed=2)
    kw = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=11, ignore_eos=True)
    ref = _llm(tmp_path, "cpu" if ACCEL == "standin" else "fused").generate(
        _prompts(), max_tokens=MAX_TOKENS, **kw
    )
    for backend in ("fused", "hybrid"):
        assert _llm(tmp_path, backend).generate(_prompts(), max_tokens=MAX_TOKENS, **kw) == ref


def test_quantized_dense_weights_become_bf16_on_the_device(tmp_path: Path) -> None:
    """A q8_0 preset: the device gets each projection dequantized to bf16 (the packed blocks
    are gone), exactly the blocks' values; the plan counts them at that size."""
    from freetokend.formats import gguf_blocks
    from freetokend.models.layers.common import Linear

    make_tiny("qwen3_moe", tmp_path, seed=4)
    host = _llm(tmp_path, "cpu", quantize="q8_0")
    dev = _llm(tmp_path, "fused", quantize="q8_0")
    host_lin = dict(host.model.named_modules())
    quantized = 0
    for name, mod in dev.model.named_modules():
        if not isinstance(mod, Linear):
            continue
        assert mod.qweight is None
        qw = getattr(host_lin[name], "qweight", None)
        if qw is not None:
            quantized += 1
            want = gguf_blocks.dequantize(qw.gguf_raw(), qw.fmt).to(torch.bfloat16)
            assert mod.weight.dtype == torch.bfloat16 and torch.equal(mod.weight.cpu(), want), name
    assert quantized > 0
    assert dense_device_bytes(host.model) == dense_device_bytes(dev.model)
    out = dev.generate(_prompts(), max_tokens=MAX_TOKENS, ignore_eos=True)
    assert all(len(o) == MAX_TOKENS for o in out)


class _EvenTokens:
    """A grammar stand-in: only even token ids are allowed (filled in place where the logits
    are, as the xgrammar constraint does with its bitmask)."""

    def fill_mask(self, logits: torch.Tensor) -> None:
        with torch.inference_mode():  # the logits are inference tensors
            logits[1::2] = float("-inf")

    def accept(self, token_id: int) -> None:
        assert token_id % 2 == 0, token_id

    def is_terminated(self) -> bool:
        return False


def _serve(llm: LLM, grammar: bool) -> list[tuple[int, float | None, Any]]:
    from freetokend.engine.sampler import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    llm.engine.add_request("g", _prompts()[0], params, _EvenTokens() if grammar else None)
    out = []
    while llm.engine.has_unfinished():
        out += [(o.token_id, o.logprob, o.top_logprobs) for o in llm.engine.step()]
    return out


def test_grammar_masks_and_logprobs_on_the_device_match_the_host(tmp_path: Path) -> None:
    """The mask is applied to the logits on the device; logprobs come back in one packed read:
    tokens, chosen logprobs and top pairs as the host path gives them."""
    make_tiny("qwen3_moe", tmp_path, seed=6)
    for grammar in (False, True):
        ref = _serve(_llm(tmp_path, "cpu"), grammar)
        got = _serve(_llm(tmp_path, "fused"), grammar)
        assert [t for t, _, _ in got] == [t for t, _, _ in ref]
        if grammar:
            assert all(t % 2 == 0 for t, _, _ in got)
        for (_, lp, top), (_, rlp, rtop) in zip(got, ref, strict=True):
            assert lp == pytest.approx(rlp, abs=LOGIT_ATOL)
            assert [i for i, _ in top] == [i for i, _ in rtop]
            assert [v for _, v in top] == pytest.approx([v for _, v in rtop], abs=LOGIT_ATOL)
