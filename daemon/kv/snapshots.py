"""Recurrent-state snapshots at positions, with their own byte budget and LRU (DESIGN §2).

A snapshot is the whole RecurrentState (conv + delta-rule state of every linear-attention layer)
of a sequence right after position ``pos``, keyed by a hash of the token prefix ``tokens[:pos]``.
Restoring one lets a hybrid model skip re-prefilling that prefix (its KV comes from the radix
tree).

Which positions get a snapshot is the policy's choice: semantic anchors (end of turn, end of
thinking, tool call / tool output boundaries), a fixed interval (a baseline), or none.

Retention under a tight budget (``retention="tiered"``, the default): a snapshot can be marked
``head`` (the deepest one its request has taken: where the session resumes when the agent only
appends) or ``frontier`` (one of the first snapshots after an edit: agents edit oldest-first, so
the next edit lands just after the last one). Those are protected: eviction takes the least
recently used unprotected snapshot first, a protected one only when no other is left, and never
to make room for an unprotected one. ``retention="lru"`` ignores the marks (plain LRU).
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .seq_state import RecurrentState

if TYPE_CHECKING:
    from .edits import EditModel

RETENTIONS = ("tiered", "lru")


def prefix_key(tokens: list[int], pos: int) -> bytes:
    return hashlib.blake2b(array("q", tokens[:pos]).tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class Snapshot:
    pos: int
    state: RecurrentState
    kind: str
    key: bytes = b""
    head: bool = False  # the deepest snapshot of its request (so far)
    frontier: bool = False  # among the first snapshots after an edit
    had_children: bool = False  # a later snapshot continued this path
    prefix: array[int] | None = None  # tokens[:pos], kept when snapshots may be spilled to disk
    edits: EditModel | None = None  # the edit model of the session that took it (kv/edits.py)

    @property
    def protected(self) -> bool:
        return self.head or self.frontier


class SnapshotStore:
    def __init__(self, budget_bytes: int, retention: str = "tiered") -> None:
        if retention not in RETENTIONS:
            raise ValueError(f"retention must be one of {RETENTIONS}, got {retention!r}")
        self.budget = budget_bytes
        self.retention = retention
        self.used = 0
        # LRU order (oldest first) within each tier: [unprotected, protected]
        self._tiers: tuple[collections.OrderedDict[bytes, Snapshot], ...] = (
            collections.OrderedDict(),
            collections.OrderedDict(),
        )
        self.saved = 0
        self.restored = 0
        self.evicted = 0
        self.keep_prefix = False  # keep each snapshot's tokens (needed to spill it with its KV)

    def __len__(self) -> int:
        return sum(len(t) for t in self._tiers)

    def _tier(self, snap: Snapshot) -> collections.OrderedDict[bytes, Snapshot]:
        return self._tiers[1 if snap.protected and self.retention == "tiered" else 0]

    def _find(self, key: bytes) -> Snapshot | None:
        return self._tiers[0].get(key) or self._tiers[1].get(key)

    def put(
        self,
        tokens: list[int],
        pos: int,
        state: RecurrentState,
        kind: str,
        *,
        head: bool = False,
        frontier: bool = False,
    ) -> Snapshot | None:
        """Stores a copy of ``state`` as the snapshot after ``tokens[:pos]``; None if it does not
        fit (larger than the budget, or only protected snapshots could make room)."""
        key = prefix_key(tokens, pos)
        old = self._find(key)
        if old is not None:
            self.mark(old, head=old.head or head, frontier=old.frontier or frontier)
            return old
        snap = Snapshot(pos, state.clone(), kind, key, head=head, frontier=frontier)
        if self.keep_prefix:
            snap.prefix = array("i", tokens[:pos])
        if not self._make_room(state.nbytes, snap.protected):
            return None
        self._tier(snap)[key] = snap
        self.used += state.nbytes
        self.saved += 1
        return snap

    def _make_room(self, size: int, protected: bool) -> bool:
        if size > self.budget:
            return False
        while self.used + size > self.budget:
            tier = self._tiers[0] if self._tiers[0] else self._tiers[1]
            if tier is self._tiers[1] and not protected and self.retention == "tiered":
                return False
            _, victim = tier.popitem(last=False)
            self.used -= victim.state.nbytes
            self.evicted += 1
        return True

    def mark(self, snap: Snapshot, *, head: bool, frontier: bool) -> None:
        """Sets the protection marks (moves the snapshot between tiers, as most recently used)."""
        tier = self._tier(snap)
        if tier.pop(snap.key, None) is None:
            return  # evicted meanwhile
        snap.head, snap.frontier = head, frontier
        self._tier(snap)[snap.key] = snap

    def get(self, tokens: list[int], pos: int) -> Snapshot | None:
        key = prefix_key(tokens, pos)
        snap = self._find(key)
        if snap is not None and snap.pos == pos:
            self._tier(snap).move_to_end(key)
            return snap
        return None

    def positions(self) -> set[int]:
        return {s.pos for t in self._tiers for s in t.values()}

    def snapshots(self) -> list[Snapshot]:
        """All snapshots, least recently used first (unprotected tier before protected)."""
        return [s for t in self._tiers for s in t.values()]
