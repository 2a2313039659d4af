"""Elastic caches in process: slot and KV resizes at safe points, through the engine hub.

The stand-in accelerator runs the offload backend's real slot cache on the CPU. Every resize
must leave the host pool's buffers where they were (same data_ptr) and greedy output unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from freetokend.engine.llm import LLM
from freetokend.engine.resize import CacheSizes, ResizeError, resize_expert_slots, resize_kv_pages
from freetokend.engine.sampler import SamplingParams
from freetokend.manager.hub import NOT_YET, EngineHub
from freetokend.manager.lane import Lane

PROMPTS = [[5, 9, 14, 3, 7, 22, 8], [11, 4, 4, 19, 2], list(range(40, 74))]  # 46 tokens: prefill
NEW_TOKENS = 8


def _llm(model_dir: Path, slots: int = 40, kv_tokens: int = 512) -> LLM:
    return LLM(
        model_dir, "offload", accelerator="standin", moe_slots=slots, kv_tokens=kv_tokens,
        max_model_len=256,
    )  # fmt: skip


def _host_ptrs(llm: LLM) -> dict[str, int]:
    return {k: t.data_ptr() for k, t in llm.banks.tensors().items()}


@pytest.fixture(scope="module")
def baseline(builtin_model_dir: Path) -> list[list[int]]:
    return _llm(builtin_model_dir).generate(PROMPTS, NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline_alone(builtin_model_dir: Path) -> list[list[int]]:
    """Each prompt run by itself. The stand-in's dense layers are torch CPU matmuls whose
    rounding depends on the rows beside a request's (a bf16 checkpoint: greedy picks flip on
    near-ties, measured on an AMD EPYC Zen 3), so a request that runs alone is compared with a
    run alone, never with one in a batch: the same arithmetic by construction."""
    return [_llm(builtin_model_dir).generate(p, NEW_TOKENS, ignore_eos=True) for p in PROMPTS]


def _drive(hub: EngineHub, n_steps: int | None = None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    steps = 0
    while hub.has_unfinished() and (n_steps is None or steps < n_steps):
        for o in hub.step():
            out.setdefault(o.request_id, []).append(o.token_id)
        steps += 1
    return out


def _submit(hub: EngineHub) -> None:
    for i, p in enumerate(PROMPTS):
        hub.add_request(f"r{i}", p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))


def test_slot_resize_keeps_host_pool_and_output(builtin_model_dir: Path, baseline) -> None:
    llm = _llm(builtin_model_dir)
    ptrs = _host_ptrs(llm)
    assert llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) == baseline
    be = llm.moe
    before = be.cache.stats()
    resident = {int(x) for x in be.cache.state.id_of_slot.tolist() if x >= 0}
    kept = resize_expert_slots(be, 8)  # shrink: the 8 most recently used experts stay
    assert kept == 8 and be.cache.num_slots == 8 and be.slots.gate_up.shape[0] == 8
    kept_ids = {int(x) for x in be.cache.state.id_of_slot.tolist() if x >= 0}
    assert kept_ids <= resident and len(kept_ids) == 8
    for slot, flat in enumerate(be.cache.state.id_of_slot.tolist()):  # slot rows hold the expert
        assert int(be.cache.state.slot_of[flat]) == slot
        assert be.slots.gate_up[slot].equal(llm.banks.gate_up[flat])
    assert be.cache.stats() == before  # counters carry over
    assert llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) == baseline
    resize_expert_slots(be, 64)  # grow to 2 x 32 experts: prefill now streams whole layers
    assert llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) == baseline
    assert be.counters["prefill_layers_streamed"] > 0
    assert _host_ptrs(llm) == ptrs
    with pytest.raises(ResizeError):
        resize_expert_slots(be, llm.banks.num_flat + 1)


def test_kv_resize_grow_and_shrink_when_idle(builtin_model_dir: Path, baseline) -> None:
    llm = _llm(builtin_model_dir, kv_tokens=256)
    assert llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) == baseline
    kv = llm.runner.kv
    assert llm.engine.prefix is not None and llm.engine.prefix.radix.cached_pages() > 0
    assert resize_kv_pages(kv, llm.engine.prefix, 64)
    assert kv.num_pages == 64 and kv.num_free + kv.num_used == 64
    assert llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) == baseline
    assert resize_kv_pages(kv, llm.engine.prefix, 4)  # idle: the prefix cache is dropped
    assert kv.num_pages == 4 and kv.num_free == 4 and kv.k.shape[1] == 4
    assert resize_kv_pages(kv, llm.engine.prefix, 32)
    assert llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) == baseline


def test_resize_queued_behind_running_requests(builtin_model_dir: Path, baseline) -> None:
    """Slots and KV growth apply at the next safe point with requests running; the outputs of
    those requests are those of an undisturbed run."""
    llm = _llm(builtin_model_dir, kv_tokens=256)
    ptrs = _host_ptrs(llm)
    hub = EngineHub(Lane("m", llm.engine))
    _submit(hub)
    out = _drive(hub, n_steps=3)  # prompts done, decoding under way
    assert llm.engine.stats().running == len(PROMPTS)
    calls = []

    def grow() -> str:
        calls.append(llm.engine.stats().running)
        resize_expert_slots(llm.moe, 64)
        assert resize_kv_pages(llm.runner.kv, llm.engine.prefix, 128)
        return "applied"

    ticket = hub.run_at_safe_point("grow", grow, drain=False)
    assert ticket.wait(0) == "applied" and calls == [len(PROMPTS)]  # engine idle between steps
    for rid, toks in _drive(hub).items():
        out.setdefault(rid, []).extend(toks)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == baseline
    assert llm.runner.kv.num_pages == 128 and llm.moe.cache.num_slots == 64
    assert _host_ptrs(llm) == ptrs


def test_kv_shrink_waits_for_running_requests(
    builtin_model_dir: Path, baseline, baseline_alone
) -> None:
    llm = _llm(builtin_model_dir, kv_tokens=256)
    hub = EngineHub(Lane("m", llm.engine))
    _submit(hub)
    out = _drive(hub, n_steps=3)
    pool = llm.runner.kv
    # Occupy the top page so the shrink must wait (pages are handed out lowest first).
    held = pool.alloc(pool.num_free)
    pool.free([p for p in held if p != pool.num_pages - 1])
    top = [pool.num_pages - 1]

    def shrink() -> object:
        return "applied" if resize_kv_pages(pool, llm.engine.prefix, 8) else NOT_YET

    ticket = hub.run_at_safe_point("shrink", shrink, drain=True)
    assert not ticket.done and llm.engine.max_batch == 0  # admission paused
    hub.add_request("late", PROMPTS[0], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for rid, toks in _drive(hub, n_steps=50).items():
        out.setdefault(rid, []).extend(toks)
        if rid == "late":
            raise AssertionError("a request was admitted while the shrink was pending")
    assert not ticket.done  # the top page is still held
    pool.free(top)
    for rid, toks in _drive(hub).items():
        out.setdefault(rid, []).extend(toks)
    assert ticket.wait(0) == "applied" and pool.num_pages == 8
    assert llm.engine.max_batch == 32  # admission resumed: the late request ran
    assert out["late"] == baseline_alone[0]  # it ran alone: after the others, before none
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == baseline


def test_switch_waits_for_the_old_model_then_parks_it(
    builtin_model_dir: Path, baseline, baseline_alone
) -> None:
    """A -> B while A decodes: A's requests finish first, B's wait; A's device caches are
    released at the swap and restored (same sizes, same host pool) when switching back."""
    from freetokend.manager.models import ModelManager

    mgr = ModelManager(lambda path, name, be: _llm(path), "offload", host_budget=1 << 40)
    a = mgr.load(str(builtin_model_dir), name="a")
    hub = EngineHub(a.lane, on_swap=mgr.on_swap)
    mgr.hub = hub
    b = mgr.load(str(builtin_model_dir), name="b")
    assert b.parked is not None and b.llm.runner.kv.num_pages == 1  # parked right after load
    ptrs = _host_ptrs(a.llm)
    _submit(hub)
    out = _drive(hub, n_steps=2)
    ticket = mgr.switch("b")
    assert not ticket.done and hub.desired is b.lane and hub.active is a.lane
    hub.add_request("on-b", PROMPTS[1], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    with pytest.raises(ValueError, match="being switched out"):  # a request rendered for A
        hub.route("late-a", a.lane)
        hub.add_request("late-a", PROMPTS[0], SamplingParams(max_tokens=2))
    order = []
    while hub.has_unfinished():
        for o in hub.step():
            out.setdefault(o.request_id, []).append(o.token_id)
            if o.finished:
                order.append(o.request_id)
    assert mgr.finish_switch(ticket, 5) == "b" and hub.active is b.lane
    assert order[-1] == "on-b" and set(order[:-1]) == {"r0", "r1", "r2"}
    assert [out[f"r{i}"] for i in range(3)] == baseline and out["on-b"] == baseline_alone[1]
    assert a.parked == CacheSizes(40, 32) and a.llm.runner.kv.num_pages == 1
    assert a.llm.moe.cache.num_slots == 1 and b.parked is None
    back = mgr.switch("a")
    assert back.wait(0) == "a" and a.parked is None  # idle: applied in the caller's thread
    assert a.llm.moe.cache.num_slots == 40 and a.llm.runner.kv.num_pages == 32
    assert _host_ptrs(a.llm) == ptrs and a.weight_loads == 1
    assert a.llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) == baseline
