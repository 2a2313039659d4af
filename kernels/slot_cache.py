"""SlotCache decode step as one Triton kernel.

Reference: `freetokend.experts.slot_cache.decode_step_reference` (same algorithm, same victims,
same outputs; the module docstring there defines the semantics). One program (grid (1,)) does
the whole step so no host sync is needed and the step can be captured in a CUDA graph. The N
routes (the flattened [T, K] ids; N is a runtime value, up to a prefill chunk: 8192 tokens x
top-8 = 65536) are walked in chunks of BLOCK_R, so no tensor grows with N and one compiled
kernel serves every batch size. Four passes, separated by block barriers:
    A  dedupe    atomic_min of the route position into scratch[flat id] -> first occurrence
    B  classify  hit / miss of each first occurrence, in route order: refresh hits, bump freq,
                 number the misses (running prefix sum across chunks); scratch[id] becomes the
                 route's outcome (its slot, or its miss rank), copy_src[rank] its id
    C  victims   one unique int64 key per slot, sorted (bitonic); the q smallest keys are the
                 victims, written to copy_dst[0:q] (one pass, not one per eviction). The sort
                 is [BLOCK_S] wide, at most SORT_BLOCK (2048): a wider cache (CHUNKED) sorts
                 each chunk of BLOCK_S slots into sort scratch, then a key's rank is the sum
                 over chunks of the keys below it (a binary search in each sorted chunk), so
                 no tensor grows with the cache either (a 4096- or 8192-wide sort spills
                 registers and takes minutes of ptxas: tests/test_kernels_compiled.py)
    D  apply     the q fills update the maps; every route reads its slot from scratch/copy_dst
scratch [num_flat] int32 is allocated by the launcher, filled with INT32_MAX (the dedupe needs
a value above any position). Outcome codes are negative so no later route of the same id can
mistake them for its own position: hit in slot s -> -1 - s, miss of rank r -> -1 - (S + r).
The launcher takes the state tensors duck-typed (`SlotTensors`) so this package does not import
the daemon; the caller passes the key layout constants so both sides share one definition.
"""

from __future__ import annotations

import sys
from typing import Protocol

import torch
import triton
import triton.language as tl

from .interp import for_device

BLOCK_R = 1024  # routes per chunk: 8 per thread at 4 warps, whatever N is
SORT_BLOCK = 2048  # the widest sort; wider caches are sorted in chunks of this many slots
INT32_MAX = (1 << 31) - 1


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
    base,
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
    """[BLOCK_S] int64 eviction keys (smallest = victim) of slots base.., and the number of
    reserved slots among them."""
    sl = base + tl.arange(0, BLOCK_S)
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
def _count_below(sorted_ptr, keys, BLOCK_S: tl.constexpr, LOG2_S: tl.constexpr):
    """For each of ``keys``, how many of the BLOCK_S ascending keys at sorted_ptr are smaller
    (a branchless binary search: LOG2_S probes, then one last compare)."""
    pos = tl.zeros([BLOCK_S], dtype=tl.int32)
    for i in tl.static_range(LOG2_S):
        half = BLOCK_S >> (i + 1)
        probe = tl.load(sorted_ptr + pos + (half - 1))
        pos = tl.where(probe < keys, pos + half, pos)
    last = tl.load(sorted_ptr + pos)
    return pos + (last < keys).to(tl.int32)


@triton.jit
def _dedupe(ids_ptr, scratch_ptr, n, BLOCK_R: tl.constexpr):
    """Pass A: scratch[id] = first position holding id."""
    for c in range(0, n, BLOCK_R):
        pos = c + tl.arange(0, BLOCK_R)
        ids = tl.load(ids_ptr + pos, mask=pos < n, other=-1)
        tl.atomic_min(scratch_ptr + ids, pos, mask=ids >= 0)


@triton.jit
def _classify(ids_ptr, scratch_ptr, slot_of_ptr, last_used_ptr, last_visit_ptr, freq_ptr,
              copy_src_ptr, n, num_slots, step, visit,
              FREQ_CAP: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """Pass B. Returns (distinct hits, distinct misses). A duplicate reads either its owner's
    position or the owner's (negative) outcome: neither equals its own position."""
    n_hit = tl.zeros((), dtype=tl.int32)
    m = tl.zeros((), dtype=tl.int32)
    for c in range(0, n, BLOCK_R):
        pos = c + tl.arange(0, BLOCK_R)
        ids = tl.load(ids_ptr + pos, mask=pos < n, other=-1)
        valid = ids >= 0
        first = valid & (tl.load(scratch_ptr + ids, mask=valid, other=-1) == pos)
        slot = tl.load(slot_of_ptr + ids, mask=first, other=-1)
        uhit = first & (slot >= 0)
        umiss = (first & (slot < 0)).to(tl.int32)
        rank = m + tl.cumsum(umiss, axis=0) - umiss
        tl.store(last_used_ptr + slot, step, mask=uhit)
        tl.store(last_visit_ptr + slot, visit, mask=uhit)
        f = tl.load(freq_ptr + ids, mask=first, other=0)
        tl.store(freq_ptr + ids, tl.minimum(f + 1, FREQ_CAP), mask=first)
        outcome = tl.where(uhit, -1 - slot, -1 - (num_slots + rank))
        tl.store(scratch_ptr + ids, outcome, mask=first)
        tl.store(copy_src_ptr + rank, ids, mask=umiss != 0)
        n_hit += tl.sum(uhit.to(tl.int32), axis=0)
        m += tl.sum(umiss, axis=0)
    return n_hit, m


@triton.jit
def _apply(ids_ptr, scratch_ptr, slot_of_ptr, id_of_slot_ptr, last_used_ptr, last_visit_ptr,
           slot_ids_ptr, cpu_ids_ptr, copy_src_ptr, copy_dst_ptr, n, num_slots, q, step, visit,
           BLOCK_R: tl.constexpr):  # fmt: skip
    """Pass D: the fills (copy list [0, q)), then each route's slot; returns the CPU routes."""
    for c in range(0, q, BLOCK_R):
        j = c + tl.arange(0, BLOCK_R)
        fill = j < q
        fid = tl.load(copy_src_ptr + j, mask=fill, other=-1)
        dst = tl.load(copy_dst_ptr + j, mask=fill, other=-1)
        old = tl.load(id_of_slot_ptr + dst, mask=fill, other=-1)
        tl.store(slot_of_ptr + old, -1, mask=fill & (old >= 0))  # victims hold no batch id
        tl.store(slot_of_ptr + fid, dst, mask=fill)
        tl.store(id_of_slot_ptr + dst, fid, mask=fill)
        tl.store(last_used_ptr + dst, step, mask=fill)
        tl.store(last_visit_ptr + dst, visit, mask=fill)
    n_cpu = tl.zeros((), dtype=tl.int32)
    for c in range(0, n, BLOCK_R):
        pos = c + tl.arange(0, BLOCK_R)
        in_n = pos < n
        ids = tl.load(ids_ptr + pos, mask=in_n, other=-1)
        valid = ids >= 0
        code = -1 - tl.load(scratch_ptr + ids, mask=valid, other=-1)
        rank = code - num_slots
        filled = valid & (rank >= 0) & (rank < q)
        victim = tl.load(copy_dst_ptr + rank, mask=filled, other=-1)
        rslot = tl.where(valid & (rank < 0), code, victim)
        cpu = tl.where(valid & (rslot < 0), ids, -1)
        tl.store(slot_ids_ptr + pos, rslot, mask=in_n)
        tl.store(cpu_ids_ptr + pos, cpu, mask=in_n)
        n_cpu += tl.sum((cpu >= 0).to(tl.int32), axis=0)
    return n_cpu


# n and layer change from call to call: specialising on them (n % 16 == 0, layer == 1) would
# JIT-compile new variants in the middle of serving
@triton.jit(do_not_specialize=["n", "layer"])
def _decode_kernel(
    ids_ptr,
    scratch_ptr,
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
    sort_ptr,
    n,
    num_slots,
    num_experts,
    layer,
    POLICY: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNKED: tl.constexpr,
    LOG2_S: tl.constexpr,
    IDX_BITS: tl.constexpr,
    PRIO_MAX: tl.constexpr,
    FREQ_CAP: tl.constexpr,
    FREQ_SHIFT: tl.constexpr,
    KEY_MAX: tl.constexpr,
):
    step = tl.load(step_ptr) + 1
    visit = tl.load(visits_ptr + layer) + 1
    # Every thread loads these scalars and one thread stores them: without a barrier a warp
    # that loads after that store counts one step more than the others (last_used, the keys)
    tl.debug_barrier()
    tl.store(step_ptr, step)
    tl.store(visits_ptr + layer, visit)
    _dedupe(ids_ptr, scratch_ptr, n, BLOCK_R)
    tl.debug_barrier()  # every first position is known
    n_hit, m = _classify(
        ids_ptr, scratch_ptr, slot_of_ptr, last_used_ptr, last_visit_ptr, freq_ptr,
        copy_src_ptr, n, num_slots, step, visit, FREQ_CAP, BLOCK_R,
    )  # fmt: skip
    tl.debug_barrier()  # the keys read the refreshed last_used of the batch's hits

    # Pass C. freq was bumped above, but only for the batch's ids: a resident one is a hit
    # (blocked, KEY_MAX), a missing one owns no slot, so no unblocked key changes.
    j = tl.arange(0, BLOCK_S)
    mask = (1 << IDX_BITS) - 1
    if CHUNKED:
        n_res = tl.zeros((), dtype=tl.int64)
        for base in range(0, num_slots, BLOCK_S):
            keys, n_res_chunk = _slot_keys(
                id_of_slot_ptr, last_used_ptr, last_visit_ptr, reserved_ptr, freq_ptr,
                visits_ptr, step, base, num_slots, num_experts,
                POLICY, BLOCK_S, IDX_BITS, PRIO_MAX, FREQ_CAP, FREQ_SHIFT, KEY_MAX,
            )  # fmt: skip
            n_res += n_res_chunk
            tl.store(sort_ptr + base + j, tl.sort(keys))
    else:
        keys, n_res = _slot_keys(
            id_of_slot_ptr, last_used_ptr, last_visit_ptr, reserved_ptr, freq_ptr, visits_ptr,
            step, 0, num_slots, num_experts,
            POLICY, BLOCK_S, IDX_BITS, PRIO_MAX, FREQ_CAP, FREQ_SHIFT, KEY_MAX,
        )  # fmt: skip
    m64 = m.to(tl.int64)
    q = (m64 * tl.load(ratio_ptr).to(tl.int64) + 32768) >> 16
    q = tl.minimum(tl.maximum(q, 1), m64)
    q = tl.minimum(q, tl.maximum(num_slots - n_res - n_hit, 0)).to(tl.int32)
    if CHUNKED:
        # q <= the unblocked slots, whose keys are unique (the slot index is in the low bits):
        # a key's rank among all of them is the sum over the sorted chunks of the keys below it
        tl.debug_barrier()  # every chunk is sorted
        for a in range(0, num_slots, BLOCK_S):
            k = tl.load(sort_ptr + a + j)
            rank = tl.zeros([BLOCK_S], dtype=tl.int32)
            for b in range(0, num_slots, BLOCK_S):
                rank += _count_below(sort_ptr + b, k, BLOCK_S, LOG2_S)
            take = (rank < q) & (k != KEY_MAX)
            tl.store(copy_dst_ptr + rank, (k & mask).to(tl.int32), mask=take)
    else:
        sorted_keys = tl.sort(keys)
        tl.store(copy_dst_ptr + j, (sorted_keys & mask).to(tl.int32), mask=j < q)
    for c in range(0, n, BLOCK_R):
        pos = c + tl.arange(0, BLOCK_R)
        tail = (pos >= q) & (pos < n)
        tl.store(copy_src_ptr + pos, -1, mask=tail)
        tl.store(copy_dst_ptr + pos, -1, mask=tail)
    tl.store(num_copies_ptr, q)
    tl.debug_barrier()  # the copy list is complete

    n_cpu = _apply(
        ids_ptr, scratch_ptr, slot_of_ptr, id_of_slot_ptr, last_used_ptr, last_visit_ptr,
        slot_ids_ptr, cpu_ids_ptr, copy_src_ptr, copy_dst_ptr, n, num_slots, q, step, visit,
        BLOCK_R,
    )  # fmt: skip
    tl.store(stats_ptr + 0, tl.load(stats_ptr + 0) + n_hit)
    tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + m)
    tl.store(stats_ptr + 2, tl.load(stats_ptr + 2) + q)
    tl.store(stats_ptr + 3, tl.load(stats_ptr + 3) + n_cpu)


def sort_block(num_slots: int) -> int:
    """The decode kernel's sort width (BLOCK_S) for a cache of ``num_slots``: the next power of
    two, at most SORT_BLOCK (wider caches are sorted in chunks of it)."""
    return min(max(2, triton.next_power_of_2(num_slots)), SORT_BLOCK)


def decode_launch_options(block_s: int) -> dict[str, int]:
    """num_warps and maxnreg of the decode kernel. The route chunk and the sort's BLOCK_S int64
    keys live in registers: 8 warps up to 1024 slots, 16 warps above. The kernel runs as one
    block, so occupancy is moot: it may take the whole register file (ptxas otherwise caps
    a 512-thread block at 64 registers and spills). Spill-free on sm_75..sm_90 at every cache
    width, the chunked sort of caches wider than SORT_BLOCK included
    (tests/test_kernels_compiled.py; an unchunked 8192-wide sort spilled 120-144 bytes)."""
    num_warps = 8 if block_s <= 1024 else 16
    return {"num_warps": num_warps, "maxnreg": min(255, 65536 // (32 * num_warps))}


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
    block_r: int = BLOCK_R,
    block_s: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch one decode step; updates `st` in place.

    flat_ids [T, K] int32. Returns (slot_ids [T, K], cpu_ids [T, K], copy_src_flat [N],
    copy_dst_slot [N], num_copies [1]), all int32, N = T * K. ``block_r``: routes per chunk
    (a power of two; tests use small ones to cross many chunk boundaries). ``block_s``: the
    sort width (a power of two; default ``sort_block(num_slots)``; tests use small ones to sort
    in many chunks).
    """
    shape = flat_ids.shape
    ids = flat_ids.reshape(-1).to(torch.int32).contiguous()
    n = ids.numel()
    num_slots = int(st.id_of_slot.shape[0])
    dev = ids.device

    def out(size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int32, device=dev)

    slot_ids, cpu_ids, src, dst, num_copies = out(n), out(n), out(n), out(n), out(1)
    scratch = torch.full((int(st.slot_of.shape[0]),), INT32_MAX, dtype=torch.int32, device=dev)
    if block_s is None:
        block_s = sort_block(num_slots)
    chunked = block_s < num_slots
    # the sorted chunks (only a cache wider than one sort needs them)
    sort_keys = torch.empty(
        triton.cdiv(num_slots, block_s) * block_s if chunked else 1, dtype=torch.int64, device=dev
    )
    kern = for_device(sys.modules[__name__], dev)._decode_kernel
    kern[(1,)](
        ids, scratch, st.slot_of, st.id_of_slot, st.last_used, st.last_visit, st.reserved,
        st.freq, st.visits, st.step, st.fill_ratio, st.stats,
        slot_ids, cpu_ids, src, dst, num_copies, sort_keys,
        n, num_slots, num_experts, layer,
        POLICY=policy,
        BLOCK_R=block_r,
        BLOCK_S=block_s,
        CHUNKED=chunked,
        LOG2_S=block_s.bit_length() - 1,
        IDX_BITS=idx_bits,
        PRIO_MAX=prio_max,
        FREQ_CAP=freq_cap,
        FREQ_SHIFT=freq_shift,
        KEY_MAX=key_max,
        **decode_launch_options(block_s),
    )  # fmt: skip
    return slot_ids.reshape(shape), cpu_ids.reshape(shape), src, dst, num_copies
