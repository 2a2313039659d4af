"""SlotCache decode step as one Triton kernel.

Reference: `freetokend.experts.slot_cache.decode_step_reference` (same algorithm, same victims,
same outputs; the module docstring there defines the semantics). One program (grid (1,)) does
the whole step so no host sync is needed and the step can be captured in a CUDA graph:
    routes  [BLOCK_N]           the flattened [T, K] routed ids, padded with -1
    dedupe  [BLOCK_N, BLOCK_N]  equality matrix -> first occurrence of each id
    slots   [BLOCK_S]           one unique int64 key per slot, sorted once (bitonic), and the
                                q smallest keys are the victims (one pass, not one per eviction)
The launcher takes the state tensors duck-typed (`SlotTensors`) so this package does not import
the daemon; the caller passes the key layout constants so both sides share one definition.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl


class SlotTensors(Protocol):
    """The SlotState fields the kernel reads and writes (shapes: see the reference module)."""

    slot_of: torch.Tensor
    id_of_slot: torch.Tensor
    last_used: torch.Tensor
    last_visit: torch.Tensor
    reserved: torch.Tensor
    freq: torch.Tensor
    visits: torch.Tensor
    step: torch.Tensor
    fill_ratio: torch.Tensor
    stats: torch.Tensor


@triton.jit
def _slot_keys(
    id_of_slot_ptr,
    last_used_ptr,
    last_visit_ptr,
    reserved_ptr,
    freq_ptr,
    visits_ptr,
    step,
    num_slots,
    num_experts,
    POLICY: tl.constexpr,
    BLOCK_S: tl.constexpr,
    IDX_BITS: tl.constexpr,
    PRIO_MAX: tl.constexpr,
    FREQ_CAP: tl.constexpr,
    FREQ_SHIFT: tl.constexpr,
    KEY_MAX: tl.constexpr,
):
    """[BLOCK_S] int64 eviction keys (smallest = victim) and the number of reserved slots."""
    sl = tl.arange(0, BLOCK_S)
    in_s = sl < num_slots
    res = tl.load(reserved_ptr + sl, mask=in_s, other=1)
    n_res = tl.sum(((res != 0) & in_s).to(tl.int64), axis=0)
    sid = tl.load(id_of_slot_ptr + sl, mask=in_s, other=-1).to(tl.int64)
    occupied = sid >= 0
    lu = tl.load(last_used_ptr + sl, mask=in_s, other=0)
    if POLICY == 0:  # LRU
        prio = lu + 1
    else:  # AGED_FREQ: frequency over age in visits of the slot's own layer
        safe = tl.maximum(sid, 0)
        vis = tl.load(visits_ptr + safe // num_experts, mask=in_s, other=0)
        lv = tl.load(last_visit_ptr + sl, mask=in_s, other=0)
        f = tl.load(freq_ptr + safe, mask=in_s, other=0).to(tl.int64)
        f = tl.minimum(f, FREQ_CAP)
        prio = 1 + (f << FREQ_SHIFT) // tl.maximum(vis - lv + 1, 1)
    prio = tl.where(occupied, tl.minimum(prio, PRIO_MAX), 0)
    key = (prio << IDX_BITS) | sl.to(tl.int64)
    blocked = (lu == step) | (res != 0) | (sl >= num_slots)
    return tl.where(blocked, KEY_MAX, key), n_res


@triton.jit
def _decode_kernel(
    ids_ptr,
    slot_of_ptr,
    id_of_slot_ptr,
    last_used_ptr,
    last_visit_ptr,
    reserved_ptr,
    freq_ptr,
    visits_ptr,
    step_ptr,
    ratio_ptr,
    stats_ptr,
    slot_ids_ptr,
    cpu_ids_ptr,
    copy_src_ptr,
    copy_dst_ptr,
    num_copies_ptr,
    n,
    num_slots,
    num_experts,
    layer,
    POLICY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    IDX_BITS: tl.constexpr,
    PRIO_MAX: tl.constexpr,
    FREQ_CAP: tl.constexpr,
    FREQ_SHIFT: tl.constexpr,
    KEY_MAX: tl.constexpr,
):
    pos = tl.arange(0, BLOCK_N)
    in_n = pos < n
    ids = tl.load(ids_ptr + pos, mask=in_n, other=-1).to(tl.int64)
    valid = ids >= 0
    # dedupe: owner = first position with the same id (padding rows keep the sentinel)
    eq = (ids[:, None] == ids[None, :]) & valid[:, None]
    owner = tl.min(tl.where(eq, pos[None, :], BLOCK_N), axis=1)
    first = valid & (owner == pos)
    slot = tl.load(slot_of_ptr + ids, mask=valid, other=-1).to(tl.int64)
    hit = valid & (slot >= 0)
    uhit = first & hit
    umiss = (first & (slot < 0)).to(tl.int64)
    n_hit = tl.sum(uhit.to(tl.int64), axis=0)
    m = tl.sum(umiss, axis=0)
    miss_rank = tl.cumsum(umiss, axis=0) - umiss

    step = tl.load(step_ptr) + 1
    tl.store(step_ptr, step)
    visit = tl.load(visits_ptr + layer) + 1
    tl.store(visits_ptr + layer, visit)
    tl.store(last_used_ptr + slot, step, mask=uhit)
    tl.store(last_visit_ptr + slot, visit, mask=uhit)
    tl.debug_barrier()  # the keys below read the refreshed last_used of the batch's hits

    keys, n_res = _slot_keys(
        id_of_slot_ptr, last_used_ptr, last_visit_ptr, reserved_ptr, freq_ptr, visits_ptr,
        step, num_slots, num_experts,
        POLICY, BLOCK_S, IDX_BITS, PRIO_MAX, FREQ_CAP, FREQ_SHIFT, KEY_MAX,
    )  # fmt: skip
    q = (m * tl.load(ratio_ptr).to(tl.int64) + 32768) >> 16
    q = tl.minimum(tl.maximum(q, 1), m)
    q = tl.minimum(q, tl.maximum(num_slots - n_res - n_hit, 0))
    sorted_keys = tl.sort(keys)
    fill = (umiss != 0) & (miss_rank < q)
    victim = tl.gather(sorted_keys, tl.minimum(miss_rank, BLOCK_S - 1), 0)
    dst = tl.where(fill, victim & ((1 << IDX_BITS) - 1), -1)

    old = tl.load(id_of_slot_ptr + dst, mask=fill, other=-1)
    tl.store(slot_of_ptr + old, -1, mask=fill & (old >= 0))
    tl.store(slot_of_ptr + ids, dst.to(tl.int32), mask=fill)
    tl.store(id_of_slot_ptr + dst, ids.to(tl.int32), mask=fill)
    tl.store(last_used_ptr + dst, step, mask=fill)
    tl.store(last_visit_ptr + dst, visit, mask=fill)
    f = tl.load(freq_ptr + ids, mask=first, other=0)
    tl.store(freq_ptr + ids, tl.minimum(f + 1, FREQ_CAP), mask=first)

    # routes: a duplicate takes the slot of its owner; unresolved routes go to the CPU
    rslot = tl.where(hit, slot, tl.gather(dst, tl.minimum(owner, BLOCK_N - 1), 0))
    rslot = tl.where(valid, rslot, -1)
    cpu = tl.where(valid & (rslot < 0), ids, -1)
    tl.store(slot_ids_ptr + pos, rslot.to(tl.int32), mask=in_n)
    tl.store(cpu_ids_ptr + pos, cpu.to(tl.int32), mask=in_n)
    tl.store(copy_src_ptr + pos, -1, mask=in_n & (pos >= q))
    tl.store(copy_dst_ptr + pos, -1, mask=in_n & (pos >= q))
    tl.store(copy_src_ptr + miss_rank, ids.to(tl.int32), mask=fill)
    tl.store(copy_dst_ptr + miss_rank, dst.to(tl.int32), mask=fill)
    tl.store(num_copies_ptr, q.to(tl.int32))

    n_cpu = tl.sum((cpu >= 0).to(tl.int64), axis=0)
    tl.store(stats_ptr + 0, tl.load(stats_ptr + 0) + n_hit)
    tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + m)
    tl.store(stats_ptr + 2, tl.load(stats_ptr + 2) + q)
    tl.store(stats_ptr + 3, tl.load(stats_ptr + 3) + n_cpu)


def decode_step_triton(
    st: SlotTensors,
    flat_ids: torch.Tensor,
    layer: int,
    num_experts: int,
    policy: int,
    *,
    idx_bits: int,
    prio_max: int,
    freq_cap: int,
    freq_shift: int,
    key_max: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch one decode step; updates `st` in place.

    flat_ids [T, K] int32. Returns (slot_ids [T, K], cpu_ids [T, K], copy_src_flat [N],
    copy_dst_slot [N], num_copies [1]), all int32, N = T * K.
    """
    shape = flat_ids.shape
    ids = flat_ids.reshape(-1).to(torch.int32).contiguous()
    n = ids.numel()
    num_slots = int(st.id_of_slot.shape[0])

    def out(size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int32, device=ids.device)

    slot_ids, cpu_ids, src, dst, num_copies = out(n), out(n), out(n), out(n), out(1)
    _decode_kernel[(1,)](
        ids, st.slot_of, st.id_of_slot, st.last_used, st.last_visit, st.reserved, st.freq,
        st.visits, st.step, st.fill_ratio, st.stats,
        slot_ids, cpu_ids, src, dst, num_copies,
        n, num_slots, num_experts, layer,
        POLICY=policy,
        BLOCK_N=max(2, triton.next_power_of_2(n)),
        BLOCK_S=max(2, triton.next_power_of_2(num_slots)),
        IDX_BITS=idx_bits,
        PRIO_MAX=prio_max,
        FREQ_CAP=freq_cap,
        FREQ_SHIFT=freq_shift,
        KEY_MAX=key_max,
    )  # fmt: skip
    return slot_ids.reshape(shape), cpu_ids.reshape(shape), src, dst, num_copies
