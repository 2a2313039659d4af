"""SlotCache: properties of the reference decode step, and the Triton kernel against it.

The kernel runs in the Triton interpreter on CPU tensors (ftkernels.interp picks the
interpreted twin of the kernel module for CPU tensors; nothing is set process-wide, so CUDA tests
in the same process still compile).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from freetokend.experts.slot_cache import (
    FREQ_CAP,
    FREQ_SHIFT,
    DecodePlan,
    EvictionPolicy,
    SlotCache,
    SlotState,
    decode_step,
    fill_count,
    fill_ratio_q16,
)

# (B_P, B_H, fill_all): ratios whose m * B_P / B_H never lands on .5 for m <= 16
BANDWIDTHS = [(1.0, 1.0, True), (11.8, 47.5, False), (1.0, 3.0, False), (2.0, 5.0, False)]


@dataclass
class Case:
    layers: int
    experts: int
    slots: int
    policy: EvictionPolicy
    bw: tuple[float, float, bool]
    steps: list[tuple[int, torch.Tensor]]  # (layer, flat ids [T, K])


@hs.composite
def cases(draw: hs.DrawFn, max_steps: int = 24, max_slots: int = 12) -> Case:
    layers = draw(hs.integers(1, 3))
    experts = draw(hs.integers(2, 8))
    slots = draw(hs.integers(1, max_slots))
    t, k = draw(hs.integers(1, 3)), draw(hs.integers(1, 3))
    steps = []
    for _ in range(draw(hs.integers(1, max_steps))):
        layer = draw(hs.integers(0, layers - 1))
        ids = draw(hs.lists(hs.integers(-1, experts - 1), min_size=t * k, max_size=t * k))
        flat = [-1 if e < 0 else layer * experts + e for e in ids]
        steps.append((layer, torch.tensor(flat, dtype=torch.int32).reshape(t, k)))
    policy = draw(hs.sampled_from(list(EvictionPolicy)))
    return Case(layers, experts, slots, policy, draw(hs.sampled_from(BANDWIDTHS)), steps)


def make_cache(c: Case, device: str = "cpu") -> SlotCache:
    cache = SlotCache(c.layers, c.experts, c.slots, c.policy, device=device)
    cache.set_fill_policy(*c.bw)
    return cache


def expected_q(m: int, n_hit: int, free: int, bw: tuple[float, float, bool]) -> int:
    """ARCHITECTURE §4.3: q = clamp(round(m * B_P / B_H), 1, m); q = m when filling all."""
    b_p, b_h, fill_all = bw
    if m == 0:
        return 0
    q = m if fill_all or b_h <= b_p else min(max(int(m * b_p / b_h + 0.5), 1), m)
    return min(q, free - n_hit)


def victim_order(before: SlotState, layer: int, e: int, policy: EvictionPolicy) -> list[int]:
    """Slots sorted by eviction preference, computed from the state before the step: empty
    slots first, then by recency (LRU) or by frequency over own-layer age (ours); ties go to
    the lowest slot index."""
    visits = before.visits.tolist()
    visits[layer] += 1  # the step counts its own visit first

    def key(s: int) -> tuple[int, int, int]:
        f = int(before.id_of_slot[s])
        if f < 0:
            return (0, 0, s)
        if policy == EvictionPolicy.LRU:
            return (1, int(before.last_used[s]), s)
        age = visits[f // e] - int(before.last_visit[s])
        return (1, (min(int(before.freq[f]), FREQ_CAP) << FREQ_SHIFT) // (age + 1), s)

    return sorted(range(before.num_slots), key=key)


def check_step(
    c: Case, before: SlotState, after: SlotState, layer: int, ids: torch.Tensor, plan
) -> None:  # type: ignore[no-untyped-def]
    flat = ids.reshape(-1).tolist()
    distinct = list(dict.fromkeys(f for f in flat if f >= 0))
    hit_ids = [f for f in distinct if before.slot_of[f] >= 0]
    miss_ids = [f for f in distinct if before.slot_of[f] < 0]
    hit_slots = {int(before.slot_of[f]) for f in hit_ids}
    free = c.slots - int(before.reserved.count_nonzero())
    q = expected_q(len(miss_ids), len(hit_ids), free, c.bw)

    # the two maps stay inverse: no slot holds two ids, no id sits in two slots
    id_of_slot, slot_of = after.id_of_slot.tolist(), after.slot_of.tolist()
    for s, f in enumerate(id_of_slot):
        assert f < 0 or slot_of[f] == s
    for f, s in enumerate(slot_of):
        assert s < 0 or id_of_slot[s] == f

    # q, the copy list, and the victims: the q least preferred slots the batch does not hit
    assert int(plan.num_copies) == q
    src, dst = plan.copy_src_flat.tolist(), plan.copy_dst_slot.tolist()
    assert src[:q] == miss_ids[:q] and all(v == -1 for v in src[q:] + dst[q:])
    lent = set(torch.nonzero(before.reserved).flatten().tolist())
    order = victim_order(before, layer, c.experts, c.policy)
    order = [s for s in order if s not in hit_slots | lent]
    assert dst[:q] == order[:q]
    assert not hit_slots & set(dst[:q])

    # every route is computed exactly once: on its slot after the copies, or on the CPU
    for f, s, cpu in zip(
        flat, plan.slot_ids.reshape(-1).tolist(), plan.cpu_ids.reshape(-1).tolist(), strict=True
    ):
        if f < 0:
            assert s == -1 and cpu == -1
        elif s >= 0:
            assert cpu == -1 and id_of_slot[s] == f
        else:
            assert cpu == f and f in miss_ids[q:]

    # hits keep their slot, recency is refreshed for everything the batch touched
    step = int(after.step[0])
    for f in hit_ids:
        assert slot_of[f] == before.slot_of[f]
    for f in hit_ids + miss_ids[:q]:
        assert int(after.last_used[slot_of[f]]) == step
    delta = (after.stats - before.stats).tolist()
    n_cpu = sum(1 for v in plan.cpu_ids.reshape(-1).tolist() if v >= 0)
    assert delta == [len(hit_ids), len(miss_ids), q, n_cpu]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_reference_properties(c: Case) -> None:
    cache = make_cache(c)
    for layer, ids in c.steps:
        before = cache.state.clone()
        plan = cache.decode_step(ids, layer)
        check_step(c, before, cache.state, layer, ids, plan)


def reserve_step_slots(cache: SlotCache, plan: DecodePlan) -> None:
    """What a prompt step does with a layer's slots while that layer computes
    (device_backends._PrefillStream): they are reserved for the next lookup."""
    slots = plan.slot_ids.reshape(-1).long()
    cache.state.reserved[slots[slots >= 0]] = 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), hs.integers(0, 3))
def test_reference_properties_with_reserved_slots(c: Case, reserve_at: int) -> None:
    """The slots a step used, reserved for the next step as a prompt step reserves them, are
    never its victims (check_step: victims and q come from the unreserved slots)."""
    cache = make_cache(c)
    for i, (layer, ids) in enumerate(c.steps):
        before = cache.state.clone()
        plan = cache.decode_step(ids, layer)
        check_step(c, before, cache.state, layer, ids, plan)
        lent = set(torch.nonzero(before.reserved).flatten().tolist())
        assert not lent & set(plan.copy_dst_slot.tolist())
        cache.state.reserved.zero_()  # the reserving layer has computed
        if i == reserve_at:
            reserve_step_slots(cache, plan)


def test_q_formula_design_example() -> None:
    """ARCHITECTURE §4.3: B_P 11.8, B_H 47.5 GB/s, m = 4 -> q = 1; offload fills everything."""
    assert fill_count(fill_ratio_q16(11.8, 47.5), 4, 0, 100) == 1
    assert fill_count(fill_ratio_q16(11.8, 47.5), 12, 0, 100) == 3
    assert fill_count(fill_ratio_q16(11.8, 47.5, fill_all=True), 4, 0, 100) == 4
    assert fill_count(fill_ratio_q16(50.0, 10.0), 4, 0, 100) == 4  # B_H <= B_P
    assert fill_count(fill_ratio_q16(1.0, 1000.0), 3, 0, 100) == 1  # always >= 1 fill
    assert fill_count(fill_ratio_q16(1, 1, True), 5, 1, 3) == 2  # 3 free slots, 1 hit
    assert fill_ratio_q16(1, 1, True) == 1 << 16


def test_too_few_slots_in_offload_sends_the_rest_to_cpu() -> None:
    cache = SlotCache(1, 16, 3)
    ids = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)
    plan = cache.decode_step(ids, 0)
    assert int(plan.num_copies) == 3
    assert plan.slot_ids.tolist() == [[0, 1, 2], [-1, -1, 0]]
    assert plan.cpu_ids.tolist() == [[-1, -1, -1], [3, 4, -1]]


def test_lru_evicts_least_recent_and_refreshes_hits() -> None:
    cache = SlotCache(2, 4, 3)
    for layer, e in [(0, 0), (0, 1), (1, 2), (0, 0)]:  # slot 0 holds flat 0 and is refreshed
        cache.decode_step(torch.tensor([[layer * 4 + e]], dtype=torch.int32), layer)
    plan = cache.decode_step(torch.tensor([[7]], dtype=torch.int32), 1)
    assert plan.copy_dst_slot[0] == 1  # flat 1 was least recently used
    assert cache.state.slot_of[1] == -1 and cache.state.slot_of[7] == 1
    assert cache.stats() == {"hits": 1, "misses": 4, "fills": 4, "cpu_routes": 0}


# -- Triton kernel vs reference (interpreter: tiny sizes) ------------------------------------
triton = pytest.importorskip("triton")
# tests/gpu/check.sh: the kernel compiled, on CUDA tensors, against the reference on the CPU
KDEV = "cuda" if os.environ.get("FT_TEST_ACCELERATOR") == "cuda" else "cpu"


def run_both(c: Case, reserve_at: int = -1) -> None:
    """Kernel and reference step for step; after step ``reserve_at`` its slots are reserved for
    the next step in both (as a prompt step reserves them)."""
    ref, ker = make_cache(c), make_cache(c, KDEV)
    ker.force_kernel = True
    for i, (layer, ids) in enumerate(c.steps):
        a, b = ref.decode_step(ids, layer), ker.decode_step(ids.to(KDEV), layer)
        for name in vars(a):
            assert torch.equal(getattr(a, name), getattr(b, name).cpu()), (i, name)
        for name, t in vars(ref.state).items():
            assert torch.equal(t, getattr(ker.state, name).cpu()), (i, name)
        ref.state.reserved.zero_()
        ker.state.reserved.zero_()
        if i == reserve_at:
            reserve_step_slots(ref, a)
            reserve_step_slots(ker, b)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_steps=5, max_slots=9), hs.integers(-1, 3))
def test_triton_matches_reference(c: Case, reserve_at: int) -> None:
    run_both(c, reserve_at)


def test_triton_matches_reference_long_sequence() -> None:
    """Enough steps for both policies to evict repeatedly, with duplicates and padding."""
    rng = random.Random(7)
    for policy in EvictionPolicy:
        steps = []
        for _ in range(12):
            layer = rng.randrange(3)
            ids = [rng.choice([-1, *range(layer * 6, layer * 6 + 6)]) for _ in range(4)]
            steps.append((layer, torch.tensor(ids, dtype=torch.int32).reshape(2, 2)))
        run_both(Case(3, 6, 5, policy, (11.8, 47.5, False), steps))
        run_both(Case(3, 6, 5, policy, (1.0, 1.0, True), steps))


def test_dispatcher_uses_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import ftkernels.slot_cache as k

    def boom(*a: object, **kw: object) -> None:
        raise AssertionError("kernel called on CPU tensors")

    monkeypatch.setattr(k, "decode_step_triton", boom)
    st = SlotState.empty(1, 4, 2)
    plan = decode_step(st, torch.tensor([[1, 2]], dtype=torch.int32), 0, 4, EvictionPolicy.LRU)
    assert plan.slot_ids.tolist() == [[0, 1]]


def run_chunked(c: Case, block_r: int, block_s: int | None = None) -> None:
    """The kernel with `block_r` routes per chunk (and a sort `block_s` wide: a cache wider
    than it is sorted chunk by chunk) against the reference, step by step."""
    from freetokend.experts import slot_cache as sc
    from ftkernels.slot_cache import decode_step_triton

    ref, ker = make_cache(c), make_cache(c, KDEV)
    for i, (layer, ids) in enumerate(c.steps):
        a = ref.decode_step(ids, layer)
        b = decode_step_triton(
            ker.state, ids.to(KDEV), layer, c.experts, int(c.policy),
            idx_bits=sc.idx_bits(c.slots), prio_max=sc.prio_max(c.slots),
            freq_cap=FREQ_CAP, freq_shift=FREQ_SHIFT, key_max=sc.KEY_MAX, block_r=block_r,
            block_s=block_s,
        )  # fmt: skip
        for name, got in zip(vars(a), b, strict=True):
            assert torch.equal(getattr(a, name), got.cpu()), (i, name)
        for name, t in vars(ref.state).items():
            assert torch.equal(t, getattr(ker.state, name).cpu()), (i, name)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_steps=4, max_slots=9), hs.sampled_from([2, 4]))
def test_triton_matches_reference_across_route_chunks(c: Case, block_r: int) -> None:
    """Batches spanning several chunks: duplicates of an id in a later chunk, misses numbered
    across chunks, copy lists longer than a chunk."""
    run_chunked(c, block_r)


def test_triton_matches_reference_prefill_chunk() -> None:
    """A prefill-sized step: 320 tokens x top-8 = 2560 routes (old kernel: a [4096, 4096]
    dedupe tensor, over Triton's element limit on a GPU), then a decode step; both policies,
    filling all and q* < m."""
    g = torch.Generator().manual_seed(5)
    layers, experts = 2, 64
    prefill = torch.randint(-1, experts, (320, 8), generator=g, dtype=torch.int32)
    prefill = torch.where(prefill >= 0, prefill + experts, prefill)  # layer 1
    decode = torch.randint(0, experts, (4, 8), generator=g, dtype=torch.int32)
    for policy in EvictionPolicy:
        for bw in ((1.0, 1.0, True), (11.8, 47.5, False)):
            c = Case(layers, experts, 48, policy, bw, [(1, prefill), (0, decode), (1, prefill[:7])])
            run_chunked(c, 1024)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_steps=4, max_slots=12), hs.sampled_from([2, 4]))
def test_triton_matches_reference_with_the_sort_in_chunks(c: Case, block_s: int) -> None:
    """A cache wider than one sort (on a GPU: wider than SORT_BLOCK, 2048 slots, e.g. every
    Qwen3-30B-A3B expert resident on an H200): chunks sorted apart, ranked across them."""
    run_chunked(c, 4, block_s)


def test_wide_cache_sorts_in_chunks_like_the_reference() -> None:
    """Many chunks, a last chunk half full, victims from every chunk: 44 slots sorted 8 at a
    time, a prefill that fills 40 of them, then decode steps that evict; both policies."""
    from ftkernels.slot_cache import SORT_BLOCK, sort_block

    assert sort_block(2000) == 2048 and sort_block(6144) == SORT_BLOCK == 2048
    g = torch.Generator().manual_seed(9)
    layers, experts = 2, 40
    steps = [(0, torch.arange(0, 40, dtype=torch.int32).reshape(10, 4))]
    for i in range(6):
        layer = i % 2
        ids = torch.randint(-1, experts, (6, 4), generator=g, dtype=torch.int32)
        steps.append((layer, torch.where(ids >= 0, ids + layer * experts, ids)))
    for policy, bw in zip(EvictionPolicy, ((1.0, 1.0, True), (11.8, 47.5, False)), strict=True):
        run_chunked(Case(layers, experts, 44, policy, bw, steps), 16, 8)
