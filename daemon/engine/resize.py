"""Elastic memory (ARCHITECTURE §6.1): resize a loaded model's expert slot cache and KV pool in place.

These functions run between engine steps (the engine hub calls them at a safe point: no
forward step in flight). They never touch the host pool (``ExpertBanks`` on the host): only the
device-side slot banks and the KV pool's storage are reallocated.

Expert slots (offload / hybrid): a new SlotCache and new slot banks of the new size; the most
recently used resident experts (as many as fit) are carried over, so a resize does not start
cold. The old banks are freed before the new ones exist (peak: the larger of the two sizes, never
the sum) and the carried experts are filled again from the host pool by a device-side copy list. Counters (hits, misses, lookup frequencies, step clocks) carry over. The slot cache holds
no per-request state, so this is safe between any two steps, with requests running.

KV pool: growing copies the pages into larger storage (page ids stay valid, so running requests
keep their page tables: safe between any two steps). Shrinking first drops the prefix cache's
pages, then succeeds only when every page at or above the new size is free; otherwise the caller
pauses admission and retries after the running requests finished.

KVPool has no resize method of its own; ``_resize_pool`` rewrites its storage, free list and
refcounts here, in one place (candidate to move into ``KVPool`` itself).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..experts.banks import ExpertBanks
from ..experts.device_backends import OffloadBackend, compact_copies
from ..experts.slot_cache import SlotCache
from ..kv.pool import KVPool
from ..runtime.staging import to_device
from .prefix import PrefixReuse

log = logging.getLogger(__name__)


class ResizeError(ValueError):
    """A requested size that cannot be used (the message says why)."""


@dataclass(frozen=True)
class CacheSizes:
    """Sizes of one model's device caches. ``moe_slots`` is None for backends without slots."""

    moe_slots: int | None
    kv_pages: int


def slot_backend(moe: object) -> OffloadBackend | None:
    """The OffloadBackend behind ``moe`` (unwrapping a RoutingRecorder), or None (cpu, fused)."""
    inner = getattr(moe, "inner", moe)
    return inner if isinstance(inner, OffloadBackend) else None


def current_sizes(moe: object, pool: KVPool) -> CacheSizes:
    be = slot_backend(moe)
    return CacheSizes(be.cache.num_slots if be is not None else None, pool.num_pages)


# ---- expert slots ---------------------------------------------------------------------------


def _empty_banks(be: OffloadBackend, rows: int) -> ExpertBanks:
    """Device banks of ``rows`` slots shaped like the host pool's banks (not zeroed)."""
    host = be.host

    def like(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else be.acc.empty((rows, *t.shape[1:]), t.dtype)

    gu, dn = like(host.gate_up), like(host.down)
    assert gu is not None and dn is not None
    return ExpertBanks(gu, dn, like(host.gate_up_bias), like(host.down_bias))


def _kept_order(cache: SlotCache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` slots of ``cache`` to carry over, most recently used first, and how many of
    them hold an expert ([n] int64 and [1] int32 device tensors: no host read). Occupied,
    unreserved slots sort before the others."""
    st = cache.state
    occupied = (st.id_of_slot >= 0) & (st.reserved == 0)
    key = torch.where(occupied, st.last_used, torch.full_like(st.last_used, -1))
    order = torch.argsort(key, descending=True, stable=True)[:n]
    count = occupied.sum().clamp(max=n).to(torch.int32).reshape(1)
    return order, count


def resize_expert_slots(be: OffloadBackend, num_slots: int) -> int:
    """Give ``be`` a slot cache of ``num_slots`` slots; returns how many experts stayed resident.

    Must run between steps. The old slot banks are released BEFORE the new ones are allocated,
    so device memory never holds both (a shrink asked for by VRAM pressure must not itself need
    old + new); the experts carried over are copied again from the host pool, their source of
    truth (under the disk tier from the RAM cache: those it no longer holds are dropped). On
    CUDA the freed blocks go back to the driver.
    """
    old = be.cache
    pool = old.num_layers * old.num_experts
    if not 1 <= num_slots <= pool:
        raise ResizeError(f"moe slots must be in [1, {pool}], got {num_slots}")
    new = SlotCache(
        old.num_layers,
        old.num_experts,
        num_slots,
        old.policy,
        device=old.state.id_of_slot.device,
        force_kernel=old.force_kernel,
    )
    src, dst = old.state, new.state
    for name in ("freq", "visits", "step", "fill_ratio", "stats"):
        getattr(dst, name).copy_(getattr(src, name))
    order, count = _kept_order(old, num_slots)
    k = order.numel()
    rows = torch.arange(k, device=order.device)
    live = rows < count  # [k] rows that receive an expert
    flat = torch.where(live, src.id_of_slot[order], -1)  # [k] int32
    ram = None
    if be.tier is not None:  # the disk tier: the host holds only the RAM cache's experts
        ram = to_device(be.tier.slots_of(torch.arange(-1, pool, dtype=torch.int32)), order.device)
        ram = ram[flat.long() + 1]  # [k] their RAM slots, -1 where the cache lacks them
        live = live & (ram >= 0)  # those are carried over; the rest are dropped (no sync)
        flat = torch.where(live, flat, -1)
    dst.id_of_slot[:k] = flat
    dst.last_used[:k] = torch.where(live, src.last_used[order], 0)
    dst.last_visit[:k] = torch.where(live, src.last_visit[order], 0)
    # slot_of[flat] = row for the live rows; the others write into a spare entry at the end
    num_flat = dst.slot_of.numel()
    spill = torch.full((num_flat + 1,), -1, dtype=torch.int32, device=order.device)
    spill[torch.where(live, flat.long(), num_flat)] = torch.where(live, rows, -1).int()
    dst.slot_of.copy_(spill[:num_flat])
    del spill
    be.slots = None  # type: ignore[assignment]  # the old banks go first ...
    _release_device_memory(be.acc.device)
    banks = _empty_banks(be, num_slots)  # ... then the new ones are allocated
    if ram is None:
        idx = flat.clamp(min=0).int()
        be._fill_from_host(banks, rows.int(), idx, count).wait()
    else:  # from their RAM slots, the rows carried over compacted first
        dst_rows, idx, count = compact_copies(rows.int(), torch.where(live, ram, -1).int(), count)
        fill = be._fill_from_host(banks, dst_rows, idx, count)
        be._ram_fills.append((fill, set(range(be.host.num_flat))))  # (reads before they land)
        fill.wait()
    be.cache, be.slots = new, banks
    return _kept_count(count)


def _kept_count(count: torch.Tensor) -> int:
    """The experts carried over, read on the host (one sync; -1 on the fake device)."""
    host = count.cpu()

    return -1 if isinstance(host, FakeTensor) else int(host[0])


def _release_device_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- KV pool --------------------------------------------------------------------------------


def kv_pages_for(pool: KVPool, tokens: int) -> int:
    """Pages needed for ``tokens`` tokens (at least one)."""
    return max(1, pool.pages_for(tokens))


def resize_kv_pages(pool: KVPool, prefix: PrefixReuse | None, num_pages: int) -> bool:
    """Resize ``pool`` to ``num_pages``; False when pages at or above the new size are still in
    use by requests (retry once they finished). Must run between steps."""
    if num_pages < 1:
        raise ResizeError(f"the KV pool needs at least one page, got {num_pages}")
    old = pool.num_pages
    if num_pages == old:
        return True
    if num_pages < old:
        if prefix is not None:
            prefix.radix.clear()  # tree-only pages; pages shared with requests stay held
        if any(pool.refcount(p) for p in range(num_pages, old)):
            return False
    pool.resize(num_pages)
    _release_device_memory(pool.device)
    return True
