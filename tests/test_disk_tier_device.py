"""The disk tier under a device slot cache (experts/device_tier.py, issue 45 item 2): disk ->
RAM cache of float slots -> device slots, under ``offload`` and ``hybrid`` on the stand-in
accelerator.

Oracle: the same backend, slot count and bandwidth profile with the whole pool in RAM
(dequantized to bf16 at load). A RAM slot holds the same dequantization of the same GGUF rows
and the device slot cache plans the same calls on the same flat ids, so the same rows reach the
same compute: logits equal bit for bit under offload at any cache size (a call whose experts
outnumber the RAM slots is filled a part at a time, computed whole), and under hybrid where no
call is split; a split call's CPU rows run in the CPU executor's smaller batches (last bits):
greedy tokens equal. The fake-CUDA tier checks placement and the host syncs.

tests/gpu/check.sh runs this file on a real GPU (FT_TEST_ACCELERATOR=cuda): the same
comparisons on the card, where fills from the RAM slots run on a copy stream the host runs
ahead of and the tier's reads must wait for them (the overwrite guard); logits there within
a tolerance (the device kernels' order is not the stand-in's argument), tokens equal. The
stand-in's own cases (chaos order, the guard forced by hand, the fake card) are skipped there.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_cuda_support import Geometry, fake_banks
from gguf_files import write_gguf
from test_gguf_experts import _prompt, _tiny

from freetokend import LLM
from freetokend.experts import device_backends
from freetokend.experts import devices as acc_mod
from freetokend.experts.accelerator import StandinAccelerator
from freetokend.experts.backend import create_backend
from freetokend.experts.banks import ActivationSpec
from freetokend.experts.device_backends import OffloadBackend, _row_copies
from freetokend.experts.device_tier import DequantReads
from freetokend.experts.disk_tier import TieredExecutor
from freetokend.experts.fakecuda import FakeCudaAccelerator
from freetokend.experts.formats import dequantize_expert

ACCEL = os.environ.get("FT_TEST_ACCELERATOR", "standin")  # tests/gpu/check.sh: cuda
CUDA = ACCEL == "cuda"
STANDIN_ONLY = pytest.mark.skipif(CUDA, reason="the stand-in's or the fake card's own case")
LOAD = dict(max_model_len=128, kv_tokens=1024, prefix_cache=False)
SLOTS = 6  # device slots (of 24 experts): fills every layer; prompts on demand in both
BANDWIDTH = (1.0, 2.0)  # B_H > B_P: hybrid sends half the misses to the CPU
BF16_EXPERT = 3 * 256 * 256 * 2  # bytes of a bf16 expert of the tiny geometry
TINY_256 = Geometry("tiny-256", layers=3, experts=8, top_k=2, hidden=256, inter=256)  # kmix's


@pytest.fixture(scope="module")
def kmix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("disk_tier_device")
    _, hf = _tiny(d)  # 3 MoE layers of 8 experts, top-2
    return write_gguf("qwen3_moe", hf, d / "m.gguf", "kmix")


def _llm(path: Path, backend: str, cache_experts: int | None = None) -> LLM:
    """``backend`` on ``ACCEL`` (the stand-in here); ``cache_experts``: the disk tier's RAM
    cache in experts (0: the smallest, top-k), None: the whole pool resident."""
    kw: dict[str, object] = dict(LOAD, accelerator=ACCEL, moe_slots=SLOTS)
    if backend == "hybrid":
        kw["bandwidth"] = BANDWIDTH
    if cache_experts is not None:
        kw["expert_cache_mb"] = max(cache_experts * BF16_EXPERT, 1) / 2**20
    return LLM(path, backend, **kw)  # type: ignore[arg-type]


def _tier(llm: LLM) -> tuple[OffloadBackend, TieredExecutor]:
    be = llm.moe
    assert isinstance(be, OffloadBackend) and be.tier is not None
    return be, be.tier


def _requests() -> tuple[list[int], list[list[int]]]:
    return _prompt(24, seed=4), [_prompt(9, seed=s) for s in range(4)]


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
@pytest.mark.parametrize("cache_experts", [0, 20])
def test_device_disk_tier_equals_the_resident_pool(  # type: ignore[no-untyped-def]
    kmix: Path, backend: str, cache_experts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokens equal (single and batched) at a RAM cache of top-k experts (a quarter of a layer:
    every call misses, a prompt's or a batch's calls fill a few tokens at a time) and at one of
    20 of the 24; logits too, but hybrid's at top-k (its split calls' CPU rows)."""
    ref = _llm(kmix, backend)  # fresh: the device cache's state decides hybrid's split
    tiered = _llm(kmix, backend, cache_experts)
    be, tier = _tier(tiered)
    assert isinstance(tier._readers, DequantReads)
    assert tier.cache.slots == (2 if cache_experts == 0 else cache_experts)
    assert be.host is tier.slots and be.cache.num_slots == SLOTS
    # the pool stays in the file: its banks hold no data; only the cache is allocated
    assert all(t.is_meta for t in tiered.banks.tensors().values())
    ids, batch = _requests()
    compacted = []
    compact = device_backends.compact_copies

    def counted(*a):  # type: ignore[no-untyped-def]
        compacted.append(1)
        return compact(*a)

    monkeypatch.setattr(device_backends, "compact_copies", counted)
    got, want = tiered.logits(ids), ref.logits(ids)
    if (cache_experts or backend == "offload") and not CUDA:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    assert bool(compacted) == (cache_experts == 0)  # the prompt's calls filled in parts
    assert tiered.generate(ids, 12, ignore_eos=True) == ref.generate(ids, 12, ignore_eos=True)
    assert tiered.generate(batch, 8, ignore_eos=True) == ref.generate(batch, 8, ignore_eos=True)
    st = tier.stats()
    assert st["misses"] > 0 and st["fills"] == st["misses"]
    assert st["bytes_read"] == st["fills"] * tiered.banks.nbytes_per_expert()  # GGUF bytes
    c = be.counters
    assert c["gpu_routes"] > 0 and c["prefill_layers_streamed"] == 0
    # the stand-in's routes are on the host already; a card's are read back once a MoE layer
    assert c["disk_tier_syncs"] > 0 if CUDA else c["disk_tier_syncs"] == 0
    if backend == "hybrid":
        assert c["cpu_routes"] > 0  # the CPU branch computed from the RAM slots
    if cache_experts == 0:
        assert st["misses"] > 3 * 8  # every layer call read its experts again


@STANDIN_ONLY
def test_chaos_order_keeps_the_tokens(kmix: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Copies that land early and rows in any order (as a GPU allows) change nothing."""
    made: list[StandinAccelerator] = []

    def chaos(name: str) -> StandinAccelerator:
        made.append(StandinAccelerator(order="chaos", seed=5))
        return made[-1]

    ids, _ = _requests()
    wants = {b: _llm(kmix, b).generate(ids, 10, ignore_eos=True) for b in ("offload", "hybrid")}
    monkeypatch.setattr(acc_mod, "create_accelerator", chaos)
    for backend in ("offload", "hybrid"):
        tiered = _llm(kmix, backend, 0)
        assert tiered.generate(ids, 10, ignore_eos=True) == wants[backend]
    assert made and all(a.stats.copies > 0 for a in made)


@STANDIN_ONLY
def test_a_ram_slot_is_not_overwritten_under_a_fill(kmix: Path) -> None:
    """A fill queued from RAM slots and not landed yet (a GPU's host runs ahead of its copy
    stream), then a read that evicts those slots: the fill lands first and copies the experts
    it was issued for; without the guard it copies the experts read over them."""
    pool = LLM(kmix, "cpu", **LOAD).banks  # the GGUF pool, for the dequantized oracle
    want = [dequantize_expert(pool, f) for f in (0, 1)]
    for guarded in (True, False):
        be, tier = _tier(_llm(kmix, "offload", 0))
        if not guarded:
            tier.before_write = None
        slots, held = tier.resident(torch.tensor([[0, 1]], dtype=torch.int32))
        fill = be.acc.copy_rows(_row_copies(be.slots, be.host, [0, 1], slots[0].tolist()))
        be._ram_fills.append((fill, held))
        assert not fill.landed()
        tier.resident(torch.tensor([[2, 3]], dtype=torch.int32))  # both RAM slots evicted
        assert set(tier.cache.slot_of) == {2, 3}
        be.acc.synchronize()
        same = [
            torch.equal(be.slots.gate_up[d].float(), gu.to(torch.bfloat16).float())
            and torch.equal(be.slots.down[d].float(), dn.to(torch.bfloat16).float())
            for d, (gu, dn) in enumerate(want)
        ]
        assert all(same) if guarded else not any(same)
        assert not be._ram_fills if guarded else be._ram_fills


def test_disk_tier_refusals_on_a_device(kmix: Path) -> None:
    with pytest.raises(ValueError, match="fused keeps every expert"):
        LLM(kmix, "fused", accelerator="standin", expert_cache_mb=1, **LOAD)  # type: ignore[arg-type]


# ---- the fake CUDA card: placement and host syncs ------------------------------------------------


def _step_syncs(be: OffloadBackend, acc: Any, layers: int) -> list[Counter[str]]:
    """Host syncs of decode steps of 1 and 4 tokens, inputs on the device then on the host."""
    g, tr, out = torch.Generator().manual_seed(0), acc.tracker, []
    for on_device in (True, False):
        for t in (1, 4):
            x = torch.randn(t, 256)
            ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)])
            w = torch.rand(t, 2)
            if on_device:
                x, ids, w = x.to(acc.device), ids.to(acc.device), w.to(acc.device)
            before = Counter(tr.syncs.by_kind)
            be.begin_step(t)
            for layer in range(layers):
                assert be.forward(layer, x, ids, w).shape == (t, 256)
            be.end_step()
            out.append(Counter(tr.syncs.by_kind) - before)
    return out


@STANDIN_ONLY
@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_disk_tier_on_the_fake_card(kmix: Path, backend: str) -> None:
    """The real CUDA code path (experts/fakecuda): the RAM cache's slots on the host, the only
    host memory pinned; the device slots on the card. The tier adds one host sync a MoE layer
    to a decode step, the read of its routes (counted as ``disk_tier_syncs``), and none where
    the routes are on the host already: the same steps on the pool resident (fake banks of the
    same geometry) are the baseline. The fake card holds no values: the routes read back are
    zeros (expert 0 of each layer)."""
    # the pool in the file (meta banks and the disk source), a RAM cache of its 24 bf16 experts
    # (a call never split: hybrid's CPU branch of a split call crosses once a part)
    cpu = LLM(kmix, "cpu", expert_cache_mb=24 * BF16_EXPERT / 2**20, **LOAD)  # type: ignore[arg-type]
    pool = cpu.banks
    assert pool.disk is not None
    layers = 3
    kw: dict[str, Any] = dict(moe_slots=12, bandwidth=BANDWIDTH if backend == "hybrid" else None)
    with FakeCudaAccelerator(vram_mib=1024) as acc:
        base = create_backend(backend, fake_banks(acc, TINY_256), layers, 8, ActivationSpec(),
                              accelerator=acc, **kw)  # fmt: skip
        want = _step_syncs(base, acc, layers)  # type: ignore[arg-type]
        pinned = acc.pinned_bytes
        be = create_backend(backend, pool, layers, 8, ActivationSpec(), accelerator=acc, **kw)
        assert isinstance(be, OffloadBackend) and be.tier is not None
        ram = be.tier.slots
        assert all(t.device.type == "cpu" for t in ram.tensors().values())
        assert acc.pinned_bytes - pinned == sum(t.nbytes for t in ram.tensors().values())
        assert be.slots.gate_up.device.type == "cuda"
        got = _step_syncs(be, acc, layers)
        read = Counter(d2h=layers)
        assert got == [w + read for w in want[:2]] + want[2:], (got, want)
        assert be._counters["disk_tier_syncs"] == 2 * layers
        assert be.tier.stats()["fills"] > 0


def test_the_daemons_auto_tier_takes_offload_and_hybrid(kmix: Path) -> None:
    """``disk_tier`` "auto" (manager/models.expert_cache_mb): weights over the host budget go to
    the tier under offload and hybrid too; fused loads them all (it has no tier)."""
    from freetokend.manager.models import expert_cache_mb

    for backend in ("cpu", "offload", "hybrid"):
        assert expert_cache_mb(kmix, 1, "auto", 0.5, backend) == 512
    assert expert_cache_mb(kmix, 1, "auto", 0.5, "fused") is None
    assert expert_cache_mb(kmix, 1 << 40, "auto", 0.5, "offload") is None  # the file fits


def test_resizing_the_device_slots_under_the_tier(kmix: Path) -> None:
    """A resize carries the device's experts over from the RAM cache (the host's only copy
    under the tier): those the cache still holds are copied from their RAM slots, the rest
    dropped; offload computes every route on the device whatever its cache holds, so the
    tokens stay the resident pool's through a shrink and a growth."""
    from freetokend.engine.resize import resize_expert_slots

    ids, batch = _requests()
    runs = []
    for cache in (None, 0):
        llm = _llm(kmix, "offload", cache)
        out = [llm.generate(ids, 6, ignore_eos=True)]
        kept = []
        for n in (3, 12):
            kept.append(resize_expert_slots(llm.moe, n))  # type: ignore[arg-type]
            out.append(llm.generate(batch, 6, ignore_eos=True))
        assert llm.moe.cache.num_slots == 12  # type: ignore[attr-defined]
        runs.append((out, kept))
    (want, kept_resident), (got, kept_tier) = runs
    assert got == want
    assert kept_resident == [3, 3] and all(k <= 2 for k in kept_tier)  # the RAM cache: 2
    assert max(kept_tier) > 0  # some copied from their RAM slots


def test_cuda_graphs_stay_off_under_the_tier(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """A decode graph cannot hold the host's read of the routes nor the disk reads: where the
    device would capture (no other blocker), the tier keeps decode eager and says why."""
    import logging
    from types import SimpleNamespace

    from freetokend.engine import build

    monkeypatch.setattr(build, "graphs_blocker", lambda *a: None)
    captured: list[object] = []
    monkeypatch.setattr(build, "DecodeGraphs", lambda *a: captured.append(a))
    runner = SimpleNamespace(moe=SimpleNamespace(tier=object()),
                             placement=SimpleNamespace(device=torch.device("cpu")))  # fmt: skip
    with caplog.at_level(logging.INFO, logger=build.log.name):
        build.capture_graphs(runner, None, "offload", 128, lambda: None)  # type: ignore[arg-type]
    assert not captured and "the disk tier reads each MoE layer's routes" in caplog.text
