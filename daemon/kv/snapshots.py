"""Recurrent-state snapshots at positions, with their own byte budget and LRU (ARCHITECTURE §5.2).

A snapshot is the whole RecurrentState (conv + delta-rule state of every linear-attention layer)
of a sequence right after position ``pos``, or a model's own state (DeepSeek-V4's windows'
keys and open compressor windows: ``SeqState.v4``; its compressed entries are in the KV pages),
keyed by a hash of the token
prefix ``tokens[:pos]``. Restoring one lets a hybrid model skip re-prefilling that prefix (its
KV comes from the radix tree).

Which positions get a snapshot is the policy's choice: semantic anchors (end of turn, end of
thinking, tool call / tool output boundaries), a fixed interval (a baseline), or none.

Retention under a tight budget (``retention="tiered"``, the default). The budget rule, in two
sentences: of the snapshots the budget holds, a session protects its head (the deepest snapshot
of its latest request: where it resumes when the agent only appends), then two recent anchors
(kv/recency.py) until its first edit, then the end of its system prompt (where a compaction
resumes, and a new session's edit frontier starts), and splits the rest between recent anchors
and its learned edit frontier (kv/edits.py) by the share of its edits that landed on recent
anchors (half each before its first edit); eviction takes the least recently used unprotected
snapshot first, and a protected one, least recently used first (sessions not seen lately), only
to make room for another protected one. Within its share, recency keeps the anchors its edits
landed on first, then the last user message, then turn ends newest first (kv/recency.py).
``retention="lru"`` ignores the marks (plain LRU).
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from dataclasses import dataclass

from .edits import Session
from .seq_state import StateSnapshot

RETENTIONS = ("tiered", "lru")


def prefix_key(tokens: list[int], pos: int) -> bytes:
    return hashlib.blake2b(array("q", tokens[:pos]).tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class Snapshot:
    pos: int
    state: StateSnapshot
    kind: str
    key: bytes = b""
    head: bool = False  # the deepest snapshot of its request (so far)
    frontier: bool = False  # among the first snapshots after an edit
    recent: bool = False  # at a recent anchor of its session's latest prompt (kv/recency.py)
    had_children: bool = False  # a later snapshot continued this path
    prefix: array[int] | None = None  # tokens[:pos], kept when snapshots may be spilled to disk
    session: Session | None = None  # the session of the request that took it (kv/edits.py)

    @property
    def protected(self) -> bool:
        return self.head or self.frontier or self.recent


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

    def find(self, key: bytes) -> Snapshot | None:
        return self._tiers[0].get(key) or self._tiers[1].get(key)

    def put(
        self,
        tokens: list[int],
        pos: int,
        state: StateSnapshot,
        kind: str,
        *,
        head: bool = False,
        frontier: bool = False,
        recent: bool = False,
    ) -> Snapshot | None:
        """Stores a copy of ``state`` as the snapshot after ``tokens[:pos]``; None if it does not
        fit (larger than the budget, or only protected snapshots could make room)."""
        key = prefix_key(tokens, pos)
        old = self.find(key)
        if old is not None:
            self.mark(
                old,
                head=old.head or head,
                frontier=old.frontier or frontier,
                recent=old.recent or recent,
            )
            return old
        snap = Snapshot(pos, state.clone(), kind, key, head, frontier, recent)
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

    def mark(
        self,
        snap: Snapshot,
        *,
        head: bool | None = None,
        frontier: bool | None = None,
        recent: bool | None = None,
    ) -> None:
        """Sets the protection marks given (None: unchanged); moves the snapshot between tiers,
        as most recently used."""
        tier = self._tier(snap)
        if tier.pop(snap.key, None) is None:
            return  # evicted meanwhile
        snap.head = snap.head if head is None else head
        snap.frontier = snap.frontier if frontier is None else frontier
        snap.recent = snap.recent if recent is None else recent
        self._tier(snap)[snap.key] = snap

    def get(self, tokens: list[int], pos: int) -> Snapshot | None:
        key = prefix_key(tokens, pos)
        snap = self.find(key)
        if snap is not None and snap.pos == pos:
            self._tier(snap).move_to_end(key)
            return snap
        return None

    def positions(self) -> set[int]:
        return {s.pos for t in self._tiers for s in t.values()}

    def snapshots(self) -> list[Snapshot]:
        """All snapshots, least recently used first (unprotected tier before protected)."""
        return [s for t in self._tiers for s in t.values()]
