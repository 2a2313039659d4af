"""Elastic split with requests in flight, now that KV pages and recurrent state live on the device
(engine/placement.py): resizing the expert slots and the KV pool between two engine steps (the
hub's safe point) while sequences are mid-decode changes no token.

Oracle: the same requests run without a resize (their tokens are themselves checked against the
``cpu`` backend in test_dense_placement.py and against transformers in test_engine_families.py).
On the CPU stand-in the device is host memory, so values are checked; on the fake card the same
resizes are checked for placement (the new KV storage is on the device) and the card's limit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_check import assert_greedy_agrees
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.core import NO_TOKEN
from freetokend.engine.resize import resize_expert_slots, resize_kv_pages
from freetokend.engine.sampler import SamplingParams

ACCEL = os.environ.get("FT_TEST_ACCELERATOR", "standin")  # tests/gpu/check.sh: cuda
MAX_TOKENS = 10
KV_TOKENS = 512


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_moe"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # qwen3_5_moe: Gated DeltaNet layers (recurrent state) beside attention layers (KV pages)
    d = tmp_path_factory.mktemp(request.param)
    make_tiny(request.param, d, seed=21)
    return d


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(8)
    return [torch.randint(2, 97, (n,), generator=g).tolist() for n in (19, 6, 33)]


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=4)
    return [greedy, seeded, greedy]


def _serve(llm: LLM, between: Any = None) -> dict[str, list[int]]:
    """Runs the prompts through the engine; ``between(step_index)`` runs between steps."""
    out: dict[str, list[int]] = {}
    for i, (p, sp) in enumerate(zip(_prompts(), _params(), strict=True)):
        llm.engine.add_request(f"r{i}", p, sp)
        out[f"r{i}"] = []
    step = 0
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            if o.token_id != NO_TOKEN:
                out[o.request_id].append(o.token_id)
        step += 1
        if between is not None:
            between(step, out)
    return out


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_resize_mid_decode_changes_no_token(model_dir: Path, backend: str) -> None:
    def load() -> LLM:
        return LLM(model_dir, backend, max_model_len=128, kv_tokens=KV_TOKENS,
                   accelerator=ACCEL, moe_slots=4, prefix_cache=False)  # fmt: skip

    ref_llm = load()
    ref = _serve(ref_llm)
    llm = load()
    pool = llm.runner.kv
    assert llm.runner.placement.on_device
    total = llm.banks.num_flat
    pages = pool.num_pages
    done: list[str] = []

    def between(step: int, out: dict[str, list[int]]) -> None:
        running = sum(0 < len(t) < MAX_TOKENS for t in out.values())
        if step == 2:  # every prompt is in; two of them decode
            assert running >= 1
            assert resize_expert_slots(llm.moe, 1) >= 0
            done.append("slots down")
        elif step == 4:
            assert running >= 1
            assert resize_kv_pages(pool, llm.engine.prefix, 2 * pages)  # grow: always now
            resize_expert_slots(llm.moe, total)
            done.append("kv up, slots up")
        elif step == 6:
            assert running >= 1
            # shrink back: the grown pages were never handed out (lowest free pages go first)
            assert resize_kv_pages(pool, llm.engine.prefix, pages)
            resize_expert_slots(llm.moe, 2)
            done.append("kv down, slots down")

    got = _serve(llm, between)
    assert done == ["slots down", "kv up, slots up", "kv down, slots down"]
    # hybrid moves routes between the device's torch ops and the host kernels as the slots
    # change: the greedy rows may part at a near-tie; the seeded row (r1) is compared exactly
    greedy = [i for i, sp in enumerate(_params()) if sp.temperature == 0]
    assert_greedy_agrees(
        [got[f"r{i}"] for i in greedy], [ref[f"r{i}"] for i in greedy],
        [_prompts()[i] for i in greedy], ref_llm, what=backend,
    )  # fmt: skip
    assert got["r1"] == ref["r1"]
    assert pool.num_pages == pages and llm.moe.cache.num_slots == 2


def test_kv_resize_on_the_fake_card_stays_on_the_device(tmp_path: Path) -> None:
    """Grow and shrink the device KV pool between decode steps on the simulated card: the new
    storage is on the device, the peak stays within the card, and the engine goes on."""
    make_tiny("qwen3_moe", tmp_path, seed=11, max_position_embeddings=1024)
    llm = LLM(tmp_path, "offload", accelerator="fake-cuda", vram_mib=1024, kv_tokens=1024)
    try:
        acc = llm.fake_device
        pool = llm.runner.kv
        llm.engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=8))
        llm.engine.step()
        llm.engine.step()
        pages = pool.num_pages
        with acc.in_thread():
            for n in (2 * pages, pages):
                acc.tracker.reset_peak()
                assert resize_kv_pages(pool, llm.engine.prefix, n)
                assert pool.num_pages == n and pool.device.type == "cuda"
                assert acc.tracker.peak <= acc.tracker.capacity
        before = acc.tracker.syncs.total
        llm.engine.step()
        assert acc.tracker.syncs.total - before == 1  # still one read per decode step
    finally:
        llm.close()
