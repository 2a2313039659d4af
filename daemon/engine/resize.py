"""Elastic memory (DESIGN §3): resize a loaded model's expert slot cache and KV pool in place.

These functions run between engine steps (the engine hub calls them at a safe point: no
forward step in flight). They never touch the host pool (``ExpertBanks`` on the host): only the
device-side slot banks and the KV pool's storage are reallocated.

Expert slots (offload / hybrid): a new SlotCache and new slot banks of the new size; the most
recently used resident experts (as many as fit) are copied over, so a resize does not start
cold. Counters (hits, misses, lookup frequencies, step clocks) carry over. The slot cache holds
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

from ..experts.banks import ExpertBanks
from ..experts.device_backends import OffloadBackend
from ..experts.slot_cache import SlotCache
from ..kv.pool import KVPool
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


def _kept_slots(cache: SlotCache, n: int) -> torch.Tensor:
    """Up to ``n`` occupied, unreserved slots of ``cache``, most recently used first."""
    st = cache.state
    occupied = ((st.id_of_slot >= 0) & (st.reserved == 0)).nonzero().flatten()
    order = torch.argsort(st.last_used[occupied], descending=True, stable=True)
    return occupied[order][:n]


def resize_expert_slots(be: OffloadBackend, num_slots: int) -> int:
    """Give ``be`` a slot cache of ``num_slots`` slots; returns how many experts stayed resident.

    Must run between steps (no prefill lease out). Old slot banks are released; on CUDA the
    freed blocks go back to the driver so other processes can use them.
    """
    if not 1 <= num_slots <= be.host.num_flat:
        raise ResizeError(f"moe slots must be in [1, {be.host.num_flat}], got {num_slots}")
    old = be.cache
    if old.lease is not None:
        raise RuntimeError("expert slot resize while a prefill lease is out (not a safe point)")
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
    keep = _kept_slots(old, num_slots)
    k = int(keep.numel())
    banks = _empty_banks(be, num_slots)
    if k:
        for name, t in banks.tensors().items():
            t[:k].copy_(be.slots.tensors()[name][keep])
        rows = torch.arange(k, device=keep.device)
        flat = src.id_of_slot[keep]
        dst.id_of_slot[:k] = flat
        dst.slot_of[flat.long()] = rows.int()
        dst.last_used[:k] = src.last_used[keep]
        dst.last_visit[:k] = src.last_visit[keep]
    be.cache, be.slots = new, banks
    _release_device_memory(be.acc.device)
    return k


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
    _release_device_memory(pool.k.device)
    return True
