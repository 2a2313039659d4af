"""fused / offload / hybrid on the CPU stand-in accelerator give the cpu backend's tokens.

The stand-in (and a GPU, under tests/gpu/check.sh) runs the dense part in torch's order and the
cpu backend in the host kernels' (fp32 checkpoints: ~1e-6 apart), so greedy tokens may part at a
near-tie: they are compared with ``greedy_check.assert_greedy_agrees``."""

from __future__ import annotations

import os

import pytest
import torch
from greedy_check import assert_greedy_agrees
from tiny_models import FAMILIES, VARIANTS, make_tiny

from freetokend import LLM
from freetokend.experts.device_backends import OffloadBackend

# tests/gpu/check.sh runs this file with FT_TEST_ACCELERATOR=cuda on a GPU machine.
ACCEL = os.environ.get("FT_TEST_ACCELERATOR", "standin")


@pytest.fixture(scope="module", params=["qwen3_5_moe", "gpt_oss", "qwen3_moe"])
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_tiny(request.param, d, seed=7)
    return d


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 97, (n,), generator=g).tolist() for n in (40, 5, 21)]


def _run(model_dir, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, max_model_len=256, kv_tokens=1024, accelerator=ACCEL, **kw)
    return llm.generate(_prompts(), max_tokens=8, ignore_eos=True), llm


class Reference:
    """The cpu backend's greedy tokens of ``_prompts()``, and that engine to score near-ties."""

    def __init__(self, model_dir) -> None:
        self.tokens, self.llm = _run(model_dir, moe_backend="cpu")

    def check(self, out: list[list[int]], what: object = "") -> None:
        assert_greedy_agrees(out, self.tokens, _prompts(), self.llm, what=what)


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


def test_fused_matches_cpu(model_dir, reference):
    reference.check(_run(model_dir, moe_backend="fused")[0], "fused")


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_slot_counts_from_one_to_all(model_dir, reference, backend):
    total = LLM(model_dir, max_model_len=64, kv_tokens=64).banks.num_flat
    for slots in sorted({1, total // 2, total}):
        out, llm = _run(model_dir, moe_backend=backend, moe_slots=slots)
        reference.check(out, (backend, slots))
        be = llm.moe
        assert isinstance(be, OffloadBackend)
        assert be.counters["gpu_routes"] > 0


def test_hybrid_runs_both_branches_with_q_between(model_dir, reference):
    # B_P / B_H = 0.5: about half of each layer's misses are filled, the rest go to the CPU.
    out, llm = _run(model_dir, moe_backend="hybrid", moe_slots=8, bandwidth=(1.0, 2.0))
    reference.check(out, "hybrid")
    be = llm.moe
    st = be.cache.stats()
    assert st["fills"] > 0 and st["cpu_routes"] > 0
    assert be.counters["cpu_routes"] > 0 and be.counters["gpu_routes"] > 0


def test_prefill_double_buffer_overlap_on_off_and_fallback(model_dir, reference):
    probe = LLM(model_dir, max_model_len=64, kv_tokens=64)
    total_experts, num_flat = probe.config.num_experts, probe.banks.num_flat
    for overlap in (True, False):
        llm = LLM(
            model_dir,
            moe_backend="offload",
            moe_slots=min(2 * total_experts + 1, num_flat),
            max_model_len=256,
            kv_tokens=1024,
            accelerator=ACCEL,
        )
        llm.moe.prefill_overlap = overlap
        reference.check(llm.generate(_prompts(), max_tokens=8, ignore_eos=True), overlap)
        assert llm.moe.counters["prefill_layers_streamed"] > 0
        if overlap:
            assert llm.moe.acc.stats.copies > 0
    # too few slots for two full-layer buffers: on-demand prefill, same tokens
    out, llm = _run(model_dir, moe_backend="offload", moe_slots=2 * total_experts - 1)
    reference.check(out, "on demand")
    assert llm.moe.counters["prefill_layers_streamed"] == 0
    assert llm.moe.counters["prefill_on_demand"] > 0


def test_bandwidth_profile_and_routing_record(model_dir, reference, tmp_path):
    import json

    from freetokend.experts.accelerator import StandinAccelerator
    from freetokend.experts.bandwidth import measure, measure_copy_bandwidth

    llm = LLM(model_dir, max_model_len=256, kv_tokens=1024, record_routing=tmp_path / "trace.jsonl")
    reference.check(llm.generate(_prompts(), max_tokens=8, ignore_eos=True), "default backend")
    prof = measure(llm.banks, StandinAccelerator(), llm.moe, top_k=llm.config.top_k)
    assert prof.b_p > 0 and prof.b_h > 0 and prof.expert_bytes == llm.banks.nbytes_per_expert()
    acc = StandinAccelerator()
    for device_list in (False, True):  # host-listed copies and the device-side copy list
        before = acc.stats.bytes
        assert measure_copy_bandwidth(llm.banks, acc, experts=4, device_list=device_list) > 0
        assert acc.stats.bytes - before == 4 * 4 * llm.banks.nbytes_per_expert()  # 4 runs
    lines = [json.loads(s) for s in (tmp_path / "trace.jsonl").read_text().splitlines()]
    cfg = llm.config
    assert {r["phase"] for r in lines} == {"prefill", "decode"}
    assert {r["layer"] for r in lines} == set(range(cfg.num_moe_layers))
    decode = [r for r in lines if r["phase"] == "decode"]
    assert all(
        len(row) == cfg.top_k and all(0 <= e < cfg.num_experts for e in row)
        for r in decode
        for row in r["ids"]
    )


@pytest.mark.parametrize("family", FAMILIES + tuple(VARIANTS))
def test_every_family_fused_and_hybrid_match_cpu(family, tmp_path):
    """Every family and its second config (shared KV, per-layer embeddings, flat routing...)
    through the accelerator backends (a light version of the sweep above)."""
    make_tiny(family, tmp_path, seed=11)
    prompts = _prompts()[:2]

    def run(**kw):
        llm = LLM(tmp_path, max_model_len=128, kv_tokens=512, accelerator=ACCEL, **kw)
        return llm.generate(prompts, max_tokens=6, ignore_eos=True), llm

    ref, ref_llm = run(moe_backend="cpu")
    assert_greedy_agrees(run(moe_backend="fused")[0], ref, prompts, ref_llm, what="fused")
    out, llm = run(moe_backend="hybrid", moe_slots=llm_half(tmp_path), bandwidth=(1.0, 2.0))
    assert_greedy_agrees(out, ref, prompts, ref_llm, what="hybrid")
    assert llm.moe.counters["cpu_routes"] > 0 and llm.moe.counters["gpu_routes"] > 0


def llm_half(model_dir) -> int:
    return max(1, LLM(model_dir, max_model_len=64, kv_tokens=64).banks.num_flat // 2)


def test_hybrid_inputs_cross_through_the_staging_buffers(model_dir, reference):
    """On the stand-in the dense part runs on the accelerator's device, so the CPU share's
    inputs take the staged path a GPU takes: packed, one queued copy into reused buffers that
    the branch waits for. The tokens above already match cpu through it; here the buffers."""
    out, llm = _run(model_dir, moe_backend="hybrid", moe_slots=8, bandwidth=(1.0, 2.0))
    reference.check(out, "hybrid")
    staging = llm.moe._staging
    assert staging._in is not None and staging._out is not None  # the staged path ran
    assert staging._out.shape[1] == llm.config.hidden_size


def test_staging_packs_exactly_and_lands_only_at_the_wait():
    from freetokend.experts.accelerator import StandinAccelerator
    from freetokend.experts.hybrid_staging import HybridStaging

    acc = StandinAccelerator()
    staging = HybridStaging(acc)
    g = torch.Generator().manual_seed(0)
    for t in (1, 3, 2, 9):  # grows for 3 and 9, reused for 2
        x = torch.randn(t, 16, generator=g, dtype=torch.float32).to(torch.bfloat16)
        w = torch.rand(t, 4, generator=g)
        ids = torch.randint(-1, 40, (t, 4), generator=g, dtype=torch.int32)
        ids[0, 0] = -1  # a route the device owns
        xh, wh, ih, ready = staging.send(x, w, ids)
        # the stand-in's copy has not landed yet: a fresh buffer holds its poison (NaN), a
        # reused one the last step's values
        assert not torch.equal(xh, x.float())
        assert torch.isnan(xh).all() == (t != 2)
        ready.wait()
        assert torch.equal(xh, x.float()) and torch.equal(wh, w) and torch.equal(ih, ids)
        assert xh.is_contiguous() and wh.is_contiguous() and ih.is_contiguous()
        assert ih.dtype == torch.int32 and ih.shape == (t, 4)
        ready.wait()  # idempotent
        out = staging.output(t, 16)
        assert out.shape == (t, 16) and out.dtype == torch.float32
    # 24 floats a row: 24 -> 32, 72 -> 128, 48 fits, 216 -> 256
    assert staging._in is not None and staging._in.numel() == 256
