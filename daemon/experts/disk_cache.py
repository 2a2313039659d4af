"""The disk tier's RAM cache (experts/disk_tier.py, issue 45): the slots' layout in RAM
(``slot_banks``: the model's own expert format, slot classes per layer types) and the policy
that decides which slot holds which expert (``RamCache``: an LRU at expert granularity,
bimodal insertion where a class cannot hold a token's experts). See disk_tier's docstring."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from .banks import ExpertBanks
from .formats import FORMATS, allocate, block_format, get_format, layered_format


class RamCache:
    """The RAM cache's policy: which slot holds which expert, least recently used first out.

    ``class_slots[c]``: the slot ids of class c; ``class_of(fid)``: the class expert ``fid`` goes
    to. ``lookup`` takes one call's distinct experts and returns their slots and the (fid, slot)
    fills to make; the counters count experts (a hit or a miss per distinct expert of a call).

    ``per_token[c]``: the experts one token uses in class c's layers (its layers times top-k;
    0: unknown). A class with fewer slots cannot hold a token's experts, and an LRU evicts each
    before the next token comes back to it (0 hits: a cyclic scan). Such a class inserts
    bimodally: a call's filled experts go back to the least recent end after the call, except
    one fill in ``BIMODAL_EVERY`` (LIP/BIP): what is resident stays until it stops being used,
    and often used experts work their way in (real routing is skewed; uniform routing then hits
    in proportion to the cache)."""

    BIMODAL_EVERY = 32

    def __init__(
        self,
        class_slots: list[list[int]],
        class_of: Callable[[int], int],
        per_token: list[int] | None = None,
    ) -> None:
        self.class_of = class_of
        self.bimodal = [
            0 < len(slots) < n
            for slots, n in zip(class_slots, per_token or [0] * len(class_slots), strict=True)
        ]
        self._fills = 0
        self._free = [len(slots) for slots in class_slots]  # free slots (the first out) per class
        # per class: slot -> fid (-1: free), the least recently used first
        self.lru: list[OrderedDict[int, int]] = [
            OrderedDict((s, -1) for s in slots) for slots in class_slots
        ]
        self.slot_of: dict[int, int] = {}
        self.hits = 0
        self.misses = 0

    @property
    def slots(self) -> int:
        return sum(len(c) for c in self.lru)

    def lookup(self, fids: Iterable[int]) -> tuple[dict[int, int], list[tuple[int, int, int]]]:
        """-> ({fid: slot} for every fid of ``fids``, [(fid, slot, evicted fid or -1) to read]);
        evicted experts leave ``slot_of``. ``fids``: distinct, none negative."""
        out: dict[int, int] = {}
        missed = []
        for f in fids:  # hits first: touched, so no miss of this call evicts them
            s = self.slot_of.get(f)
            if s is None:
                missed.append(f)
                continue
            self.lru[self.class_of(f)].move_to_end(s)
            out[f] = s
        fills = []
        for f in missed:
            lru = self.lru[self.class_of(f)]
            s, old = next(iter(lru.items()))
            if old in out:
                raise RuntimeError(
                    f"the expert cache class of expert {f} holds fewer slots than one call needs"
                )
            lru.move_to_end(s)
            if old >= 0:
                del self.slot_of[old]
            lru[s] = f
            self.slot_of[f] = s
            out[f] = s
            fills.append((f, s, old))
        for f, s, old in fills:  # a class too small for a token's experts: inserted bimodally
            c = self.class_of(f)
            self._free[c] -= old < 0
            if self.bimodal[c] and not self._free[c]:  # (filling free slots first)
                self._fills += 1
                if self._fills % self.BIMODAL_EVERY:
                    self.lru[c].move_to_end(s, last=False)
        self.hits += len(out) - len(missed)
        self.misses += len(missed)
        return out, fills

    def reserve(self, fids: Iterable[int], keep: set[int]) -> list[tuple[int, int, int]]:
        """Slots for experts read ahead (``fids``, distinct): resident ones touched, missing ones
        given the least recently used slots -> [(fid, slot, evicted fid or -1)] to read. Never
        evicts an expert of ``keep`` (the running call's) nor of ``fids``: it stops there. Not
        counted as hits or misses (the call that uses them counts)."""
        fids = list(fids)
        missed = []
        for f in fids:
            s = self.slot_of.get(f)
            if s is None:
                missed.append(f)
            else:
                self.lru[self.class_of(f)].move_to_end(s)
        fills = []
        wanted = set(fids)
        for f in missed:
            lru = self.lru[self.class_of(f)]
            s, old = next(iter(lru.items()))
            if old in keep or old in wanted:
                continue  # this class is full of what runs and what is wanted
            lru.move_to_end(s)
            if old >= 0:
                del self.slot_of[old]
            else:
                self._free[self.class_of(f)] -= 1
            lru[s] = f
            self.slot_of[f] = s
            fills.append((f, s, old))
        return fills

    def forget(self, fid: int) -> None:
        """Expert ``fid`` is no longer in its slot (a failed read): the slot is free, first out."""
        s = self.slot_of.pop(fid, None)
        if s is not None:
            lru = self.lru[self.class_of(fid)]
            lru[s] = -1
            lru.move_to_end(s, last=False)
            self._free[self.class_of(fid)] += 1


def _float_dtype(pool: ExpertBanks) -> torch.dtype:
    b = pool.gate_up_bias
    return b.dtype if b is not None else torch.bfloat16


def slot_banks(
    pool: ExpertBanks, num_experts: int, cache_bytes: int, group: int
) -> tuple[ExpertBanks, list[list[int]], list[int]]:
    """The RAM cache's slot banks for ``pool`` (its format; weight banks need not hold data)
    within about ``cache_bytes``, at least ``group`` slots per class (one token's experts of a
    layer: the model's top-k) -> (banks, slot ids per class, class of each MoE layer).

    A per-layer format's slot banks are virtual layers of ``group`` slots each (the format's
    experts per layer), so a class grows by ``group`` experts at a time, not by a layer's."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    fmt = get_format(pool.format)
    h, inter = pool.hidden_size, pool.intermediate_size
    if fmt.in_blocks:
        inter = pool.gate_up.shape[1] // 2
        h = pool.down.shape[1]
    dt = _float_dtype(pool)
    bias = pool.gate_up_bias is not None
    layers = pool.num_flat // num_experts
    if fmt.layer_types is None:
        per = fmt.nbytes_per_expert(h, inter, dt)
        n = min(pool.num_flat, max(group, cache_bytes // max(per, 1)))
        banks = allocate(pool.format, n, h, inter, dt, bias=bias)
        return banks, [list(range(n))], [0] * layers
    pairs = list(fmt.layer_types)
    distinct = list(dict.fromkeys(pairs))
    count = {p: pairs.count(p) for p in distinct}
    size = {p: FORMATS[block_format(*p)].nbytes_per_expert(h, inter, dt) for p in distinct}
    most = {p: -(-count[p] * num_experts // group) for p in distinct}  # the class's whole pool
    total = sum(count[p] * size[p] for p in distinct)
    virtual = {}
    for p in distinct:  # a class's share of the cache = its share of the pool
        share = cache_bytes * count[p] * size[p] / total
        virtual[p] = min(most[p], max(1, int(share // (group * size[p]))))
    left = cache_bytes - sum(virtual[p] * group * size[p] for p in distinct)
    for p in sorted(distinct, key=lambda p: virtual[p] / most[p]):  # the rounding's leftover
        if virtual[p] < most[p] and group * size[p] <= left:
            virtual[p] += 1
            left -= group * size[p]
    vpairs = [p for p in distinct for _ in range(virtual[p])]
    banks = allocate(layered_format(vpairs), len(vpairs) * group, h, inter, dt, bias=bias)
    classes: list[list[int]] = [[] for _ in distinct]
    for v, p in enumerate(vpairs):
        classes[distinct.index(p)] += range(v * group, (v + 1) * group)
    return banks, classes, [distinct.index(p) for p in pairs]
