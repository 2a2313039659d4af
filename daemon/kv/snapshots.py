"""Recurrent-state snapshots at positions, with their own byte budget and LRU (DESIGN §2).

A snapshot is the whole RecurrentState (conv + delta-rule state of every linear-attention layer)
of a sequence right after position ``pos``, keyed by a hash of the token prefix ``tokens[:pos]``.
Restoring one lets a hybrid model skip re-prefilling that prefix (its KV comes from the radix
tree).

Which positions get a snapshot is the policy's choice: semantic anchors (end of turn, end of
thinking, tool call / tool output boundaries), a fixed interval (a baseline), or none.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from dataclasses import dataclass

from .seq_state import RecurrentState


def prefix_key(tokens: list[int], pos: int) -> bytes:
    return hashlib.blake2b(array("q", tokens[:pos]).tobytes(), digest_size=16).digest()


@dataclass
class Snapshot:
    pos: int
    state: RecurrentState
    kind: str


class SnapshotStore:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self._lru: collections.OrderedDict[bytes, Snapshot] = collections.OrderedDict()
        self.saved = 0
        self.restored = 0

    def __len__(self) -> int:
        return len(self._lru)

    def put(self, tokens: list[int], pos: int, state: RecurrentState, kind: str) -> bool:
        key = prefix_key(tokens, pos)
        if key in self._lru:
            self._lru.move_to_end(key)
            return True
        size = state.nbytes
        if size > self.budget:
            return False
        while self.used + size > self.budget:
            _, old = self._lru.popitem(last=False)
            self.used -= old.state.nbytes
        self._lru[key] = Snapshot(pos, state.clone(), kind)
        self.used += size
        self.saved += 1
        return True

    def get(self, tokens: list[int], pos: int) -> Snapshot | None:
        key = prefix_key(tokens, pos)
        snap = self._lru.get(key)
        if snap is not None and snap.pos == pos:
            self._lru.move_to_end(key)
            return snap
        return None

    def positions(self) -> set[int]:
        return {s.pos for s in self._lru.values()}
