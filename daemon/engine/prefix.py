"""Prefix reuse for new requests: KV pages from the radix tree, recurrent state from snapshots.

The engine core calls four hooks:
  restore(tokens, state)      on admission: fill ``state`` with the deepest reusable prefix,
                              return the number of prompt tokens it covers (cached tokens)
  chunk_end(tokens, fed, end) while planning prefill: stop a chunk at the next snapshot point so
                              the state there can be captured
  after_forward(tokens, state) after a step: snapshot the state if it sits on a snapshot point
  release(tokens, state)      when a request ends: its full pages go into the radix tree

Models without linear attention (Qwen3-MoE, GPT-OSS, Mixtral, OLMoE) reuse KV at any position:
all positions are kept in the pool, so sliding-window layers restore from it too. Hybrid models
(Gated DeltaNet) can resume only where a snapshot of the recurrent state exists, and so can a
model with its own per-sequence state (DeepSeek-V4's windows' keys and open compressor
windows, ``SeqState.v4``): it resumes from a snapshot of that state, anywhere, an open
compressor window included, the KV pages of the prefix held as for any model (V4's compressed
entries are in those pages: a snapshot's size does not grow with its position).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from ..kv import recency
from ..kv.edits import EditModel, Session
from ..kv.pool import KVPool
from ..kv.radix import RadixCache
from ..kv.seq_state import ModelState, RecurrentState, SeqState
from ..kv.snapshots import Snapshot, SnapshotStore
from ..kv.spill import SnapshotSpill, SpillReport

RECENT_FLOOR = 2  # recent anchors a session keeps until its first edit, budget permitting
HEADER_GAP = 2  # tokens between a turn's end and the next turn's opening token (ChatML: "\n")
HEADER_MAX = 8  # tokens of a turn header after its opening token (a role and its end)


@dataclass(frozen=True)
class SnapshotPolicy:
    """Where snapshots are taken: after anchor tokens, every ``interval`` tokens, or nowhere.

    anchors      at the anchors retention keeps (each prompt's recent anchors and the edit
                 frontier; a prefill is split only there), at anchors that fall on a chunk end or
                 in decoding, and at each prompt's end
    anchors:all  at every anchor (a prefill stops at each: one more forward step per anchor)
    interval:N   every N tokens (the baseline)
    """

    anchor_ids: dict[int, str]
    interval: int = 0  # > 0: fixed-interval baseline instead of anchors
    enabled: bool = True
    split_all: bool = False  # stop prefill chunks at every anchor, not only at frontier candidates
    # (the token that opens a turn, the one that ends its header), when the family has one
    turn_header: tuple[int, int] | None = None

    @classmethod
    def parse(
        cls, spec: str, anchor_ids: dict[int, str], turn_header: tuple[int, int] | None = None
    ) -> SnapshotPolicy:
        if spec in ("anchors", "anchors:all"):
            return cls(anchor_ids, split_all=spec == "anchors:all", turn_header=turn_header)
        if spec == "none":
            return cls({}, enabled=False)
        if spec.startswith("interval:") and spec[9:].isdigit() and int(spec[9:]) > 0:
            return cls({}, interval=int(spec[9:]))
        raise ValueError(
            f"snapshot policy must be 'anchors', 'anchors:all', 'interval:N' or 'none', got {spec!r}"
        )

    def kind_at(self, tokens: list[int], pos: int) -> str | None:
        """The snapshot kind after tokens[:pos], or None."""
        if not self.enabled or pos <= 0:
            return None
        if self.interval:
            return "interval" if pos % self.interval == 0 else None
        return self.anchor_ids.get(tokens[pos - 1])

    def after_header(self, tokens: list[int], pos: int) -> int | None:
        """The position after the header of the turn that opens right after ``pos`` (at most
        ``HEADER_GAP`` tokens later, its header at most ``HEADER_MAX`` tokens long), or None."""
        if self.turn_header is None:
            return None
        start, end = self.turn_header
        for i in range(pos, min(pos + HEADER_GAP, len(tokens))):
            if tokens[i] == start:
                for j in range(i + 1, min(i + 1 + HEADER_MAX, len(tokens))):
                    if tokens[j] == end:
                        return j + 1
                return None
        return None


@dataclass
class Track:
    """Per request in flight: its session, the last snapshot on its path, and where it splits its
    prefill to take snapshots (frontier marks left to give, recent anchors to keep)."""

    session: Session
    parent: Snapshot | None = None
    frontier_left: int = 0
    frontier_after: int = 0  # only snapshots past this position (the edit) join the frontier
    recent: set[int] = field(default_factory=set)  # positions of the recent anchors it keeps
    root: int | None = None  # the end of its system prompt when it keeps it (in ``recent`` too)


class PrefixReuse:
    def __init__(
        self,
        pool: KVPool,
        hybrid: bool,
        policy: SnapshotPolicy,
        snapshot_budget: int,
        retention: str = "tiered",
        frontier: int = 2,
        state_bytes: Callable[[int], int] | None = None,
    ) -> None:
        """``hybrid``: a sequence resumes only from a snapshot of its state (linear attention,
        or a model's own state); ``state_bytes``: the bytes of such a state after n tokens when
        they depend on n (DeepSeek-V4's window fills, its open windows vary; default: the fresh
        sequence's state's size)."""
        self.pool = pool
        self.radix = RadixCache(pool)
        self.hybrid = hybrid
        self.policy = policy
        self.snapshots = SnapshotStore(snapshot_budget, retention) if hybrid else None
        self.edits = EditModel()
        self.frontier = frontier  # snapshots protected after an edit (see kv/edits.py)
        self._tracks: dict[int, Track] = {}  # id(SeqState) of a request in flight -> its track
        self.spill: SnapshotSpill | None = None  # snapshots on disk (restart resume)
        self.state_bytes = state_bytes

    # ---- admission ----------------------------------------------------------------------------
    def restore(self, tokens: list[int], state: SeqState) -> int:
        """Fills the fresh ``state`` with the deepest reusable prefix of ``tokens``; returns its
        length (0: nothing reused, ``state`` untouched). At least one token is left to feed."""
        if self.spill is not None and state.recurrent is not None:
            self._load_spilled(tokens, state.recurrent)
        pages, matched = self.radix.match_prefix(tokens)
        limit = min(matched, len(tokens) - 1)
        pos, snap = self._resume_point(tokens, limit)
        if pos <= 0:
            self._track(state, tokens, matched, None)
            return 0
        full, rest = divmod(pos, self.pool.page_size)
        held = pages[: full + (1 if rest else 0)]
        # Hold the pages first: making room for the copy-on-write page may evict tree leaves.
        self.pool.retain(held)
        if rest:  # copy-on-write of the partial page: the request will write after `pos`
            fresh = self._alloc_page()
            if fresh is None:
                self.pool.free(held)
                self._track(state, tokens, matched, None)
                return 0
            self.pool.copy_page(pages[full], fresh, rest)
            self.pool.free([pages[full]])
            state.pages = pages[:full] + [fresh]
        else:
            state.pages = list(held)
        if snap is not None:
            assert self.snapshots is not None
            _restore_state(state, snap)
            self.snapshots.restored += 1
        self._track(state, tokens, matched, snap)
        state.num_tokens = pos
        return pos

    def _load_spilled(self, tokens: list[int], template: RecurrentState) -> None:
        """Brings back from disk the deepest spilled snapshot on this prompt's path that beats
        what memory offers (its KV into the tree, its state into the store). ``template``: the
        fresh sequence's recurrent state, which a file's state must match in shape and dtype."""
        assert self.spill is not None and self.snapshots is not None
        _, matched = self.radix.match_prefix(tokens)
        best, _ = self._resume_point(tokens, min(matched, len(tokens) - 1))
        for rec in self.spill.candidates(tokens, above=best):
            state = self.spill.load(rec, tokens, self.pool, self.radix, template)
            if state is not None:
                self.snapshots.put(tokens, rec.position, state, rec.kind, head=True)
                return

    def unspilled(self) -> bool:
        """Whether a protected snapshot is not on disk yet (what ``spill_now`` would write)."""
        if self.spill is None or self.snapshots is None:
            return False
        done = self.spill.records
        return any(
            s.protected
            and s.prefix is not None
            and isinstance(s.state, RecurrentState)  # the only kind spilled
            and s.key.hex() not in done
            for s in self.snapshots.snapshots()
        )

    def spill_now(self) -> SpillReport | None:
        """Writes the protected snapshots (session heads first, then edit frontiers) to disk."""
        if self.spill is None or self.snapshots is None:
            return None
        snaps = [s for s in reversed(self.snapshots.snapshots()) if s.protected]
        snaps.sort(key=lambda s: not s.head)  # stable: heads first, each most recent first
        return self.spill.spill(snaps, self.pool, self.radix)

    def _alloc_page(self) -> int | None:
        if self.pool.num_free == 0:
            self.radix.evict(1)
        if self.pool.num_free == 0:
            return None
        return self.pool.alloc(1)[0]

    def _track(
        self, state: SeqState, tokens: list[int], matched: int, snap: Snapshot | None
    ) -> None:
        """Starts the request's snapshot track, with its session (continued from the snapshot it
        resumes, else a new one on the engine-wide edit model).

        An edit is a prompt that leaves a cached path before its end (an agent rewrote its
        context), not one that only goes on after the last prompt (resuming at a ``prompt_end``
        snapshot, the generated tokens re-rendered). Then the deepest snapshot point before the
        edit is learned (its recency label if it was a recent anchor of the session's previous
        prompt, else its kind), and the first snapshots of edit kinds past ``limit`` (where the
        prompt leaves the cached KV) are protected as the session's edit frontier. A prompt that
        leaves the cache within its first exchange is a new session (sharing another's system
        prompt, say): it gets a frontier (edits land on the oldest content first) and the
        engine-wide model, and teaches nothing. Every request marks the recent anchors of its
        prompt that its session still edits (kv/recency.py).
        """
        if self.snapshots is None:
            return
        limit = min(matched, len(tokens) - 1)
        start = self._first_exchange(tokens, limit)
        latest = snap.session.latest() if snap is not None and snap.session else None
        prev = latest if not start else None
        session = prev.next() if prev is not None else Session(self.edits.fork(EditModel.PRIOR))
        session.prompt_end = len(tokens)
        ids = self.policy.anchor_ids
        session.anchors = frozenset(i + 1 for i, t in enumerate(tokens) if t in ids)
        track = Track(session, parent=snap, frontier_after=limit)
        # Resuming at the end of the session's last prompt (an older prompt's end is an edit)
        appended = snap is not None and snap.kind == "prompt_end"
        appended &= latest is None or (snap is not None and snap.pos == latest.prompt_end)
        edited = not appended and not start
        edited &= (snap is not None and snap.had_children) or self.radix.diverges(tokens, matched)
        if edited and (point := self._ideal_point(tokens, limit, prev)) is not None:
            pos, kind = point
            label = prev.recent.get(pos, kind) if prev is not None else kind
            session.edits.observe(label)
            if snap is not None:  # a resume from a snapshot: reliable enough to teach all
                self.edits.observe(label)
        recent, root, frontier = self._shares(session, state)
        if root:
            track.root = recency.first_turn_end(
                tokens, len(tokens), self.policy.kind_at, self.policy.after_header
            )
        if edited or start or snap is None:
            track.frontier_left = min(self.frontier, frontier)
        if snap is not None and track.frontier_left:
            self.snapshots.mark(snap, frontier=False)  # the edit moved past it
        self._mark_recent(track, tokens, limit, prev, recent)
        self._tracks[id(state)] = track

    def _shares(self, session: Session, state: SeqState) -> tuple[int, bool, int]:
        """How many recent anchors this request may protect, whether it keeps its system
        prompt's end, and how many frontier snapshots it may mark. Of the snapshots the budget
        holds, besides its head: ``RECENT_FLOOR`` recent anchors until the session's first edit,
        then the system prompt's end, then the rest split by the share of the session's edits
        that landed on recent anchors (half each before its first edit; kv/snapshots.py)."""
        assert self.snapshots is not None
        size = self._snapshot_size(state, session.prompt_end)
        spare = max(0, self.snapshots.budget // max(1, size) - 1)  # besides the head
        if not self.policy.anchor_ids:
            return 0, False, spare
        edits = session.edits
        floor = 0 if edits.own else min(spare, RECENT_FLOOR)
        root = spare > floor
        rest = spare - root
        recent = min(rest, max(floor, math.ceil(rest * edits.recent_share())))
        return recent, root, rest - recent

    def _snapshot_size(self, state: SeqState, tokens: int) -> int:
        """The bytes of one snapshot of ``state``'s kind, at this prompt's end (a model's own
        state's size depends on the position, within a bound)."""
        if self.state_bytes is not None:
            return self.state_bytes(tokens)
        st = state.snapshot_state()
        return st.nbytes if st is not None else 0

    def _mark_recent(
        self, track: Track, tokens: list[int], limit: int, prev: Session | None, cap: int
    ) -> None:
        """Chooses the (at most ``cap``) recent anchors this request keeps; demotes the previous
        prompt's others and marks the kept ones that are already snapshots (the rest are taken
        in prefill)."""
        assert self.snapshots is not None
        if not self.policy.anchor_ids:
            return
        session = track.session
        session.recent = recency.recent_anchors(tokens, len(tokens), self.policy.kind_at)
        edits = session.edits
        kept = [
            p
            for p in recency.shared(session.recent, len(tokens))
            if any(edits.admits_recent(x) for x in recency.cluster(session.recent, p, len(tokens)))
        ]

        def learned(label: str) -> bool:
            return edits.own > 0 and edits.admits_recent(label)

        track.recent = set(recency.ranked(session.recent, kept, learned, len(tokens))[:cap])
        if track.root is not None:
            track.recent.add(track.root)
        if prev is not None and (head := self.snapshots.find(prev.head_key)) is not None:
            self.snapshots.mark(head, head=False)  # the session moved on (resumed or not there)
        for key in prev.recent_keys if prev is not None else ():
            old = self.snapshots.find(key)
            if old is not None and not (old.pos <= limit and old.pos in track.recent):
                self.snapshots.mark(old, recent=False)
        for p in sorted(track.recent):
            if p > limit:
                break
            if (old := self._snapshot_near(tokens, p, limit)) is not None:
                self.snapshots.mark(old, recent=True)
                old.session = session
                session.recent_keys.append(old.key)

    def _snapshot_near(self, tokens: list[int], pos: int, limit: int) -> Snapshot | None:
        """A snapshot on this path at ``pos`` or up to ``GAP`` tokens after it: an anchor right
        before an earlier prompt's end was served by that prompt's head (kv/recency.py)."""
        assert self.snapshots is not None
        near = [q for q in self.snapshots.positions() if pos <= q <= min(pos + recency.GAP, limit)]
        for q in sorted(near):
            if (snap := self.snapshots.get(tokens, q)) is not None:
                return snap
        return None

    def _first_exchange(self, tokens: list[int], limit: int) -> bool:
        """Fewer than two ends of turn before ``limit``: inside the system prompt or the first
        user message, which agents do not edit."""
        ends = sum(1 for t in tokens[:limit] if self.policy.anchor_ids.get(t) == "end_of_turn")
        return ends < 2

    def _ideal_point(
        self, tokens: list[int], limit: int, prev: Session | None = None
    ) -> tuple[int, str] | None:
        """The deepest snapshot point at or before ``limit`` (where the edit is) and its kind;
        with ``prev``, one that was an anchor of the session's previous prompt too (the cached
        path can run past the session's own edit along another session sharing its start)."""
        for p in range(limit, 0, -1):
            if (kind := self.policy.kind_at(tokens, p)) is not None:
                if prev is None or not prev.anchors or p in prev.anchors:
                    return p, kind
        return None

    def _resume_point(self, tokens: list[int], limit: int) -> tuple[int, Snapshot | None]:
        if not self.hybrid:
            return limit, None
        assert self.snapshots is not None
        for pos in sorted(self.snapshots.positions(), reverse=True):
            if pos <= limit and (snap := self.snapshots.get(tokens, pos)) is not None:
                return pos, snap
        return 0, None

    # ---- planning and after a step ------------------------------------------------------------
    def chunk_end(
        self, tokens: list[int], fed: int, end: int, state: SeqState | None = None
    ) -> int:
        """Where the prefill chunk [fed, end) must stop so a snapshot can be taken there.

        A split costs a whole extra forward step (with an offloaded MoE, another sweep over the
        experts), so with anchors only the snapshots retention will keep are worth one: edit
        frontier candidates and the recent anchors the request keeps. The prompt's end needs no
        split; anchors that fall on a chunk end
        or in decoding are snapshotted for free. The interval baseline splits at every point.
        """
        if self.snapshots is None or not self.policy.enabled:
            return end
        track = self._tracks.get(id(state)) if state is not None else None
        for pos in range(fed + 1, end):
            kind = self.policy.kind_at(tokens, pos)
            split = self.policy.interval or self.policy.split_all
            keep = track is not None and pos in track.recent
            if kind and (split or keep or self._frontier_candidate(track, pos, kind)):
                return pos
            if track is not None and pos == track.root:  # after a turn header: no anchor there
                return pos
        return end

    def _frontier_candidate(self, track: Track | None, pos: int, kind: str) -> bool:
        return (
            track is not None
            and track.frontier_left > 0
            and pos != track.root  # kept already (a new session's frontier starts there)
            and pos > track.frontier_after  # past the edit: where the next one lands
            and track.session.edits.admits(kind)
        )

    def after_forward(self, tokens: list[int], state: SeqState, prompt_len: int = 0) -> None:
        """Snapshots the recurrent state if it now sits on a snapshot point. With anchors, the end
        of the prompt is one too: an agent's next request extends this prompt (the generation
        prompt ``<|im_start|>assistant\n`` is always kept), so that is where it resumes."""
        if self.snapshots is None or state.snapshot_state() is None:
            return
        pos = state.num_tokens
        kind = self.policy.kind_at(tokens, pos)
        if kind is None and pos == prompt_len and self.policy.anchor_ids:
            kind = "prompt_end"
        track = self._tracks.get(id(state))
        if kind is None and track is not None and pos == track.root:
            kind = "turn_header"  # the system prompt and the next turn's header
        if kind is not None:
            self._snapshot(tokens, state, kind)

    def _snapshot(self, tokens: list[int], state: SeqState, kind: str) -> None:
        st = state.snapshot_state()
        assert self.snapshots is not None and st is not None
        track = self._tracks.get(id(state)) or Track(Session(self.edits.fork(EditModel.PRIOR)))
        pos = state.num_tokens
        frontier = self._frontier_candidate(track, pos, kind)
        recent = pos in track.recent
        snap = self.snapshots.put(
            tokens, pos, st, kind, head=True, frontier=frontier, recent=recent
        )
        if snap is None:
            return
        snap.session = track.session
        track.session.head_key = snap.key
        if recent:
            track.session.recent_keys.append(snap.key)
        track.frontier_left -= frontier
        parent = track.parent
        if parent is not None and parent is not snap:  # the new snapshot is the request's head
            parent.had_children = True
            self.snapshots.mark(parent, head=False)
        track.parent = snap

    def release(self, tokens: list[int], state: SeqState) -> None:
        self._tracks.pop(id(state), None)
        self.radix.insert(tokens[: state.num_tokens], state.pages)

    def evict(self, pages: int) -> int:
        return self.radix.evict(pages)


def _restore_state(state: SeqState, snap: Snapshot) -> None:
    """Puts the snapshot's state into the fresh sequence ``state``: the DeltaNet state copied
    into its tensors, or a model's own state (replaced by every forward) as a copy."""
    if state.recurrent is not None:
        assert isinstance(snap.state, RecurrentState)
        state.recurrent.conv.copy_(snap.state.conv)
        state.recurrent.ssm.copy_(snap.state.ssm)
        return
    assert state.v4 is not None, "a snapshot for a sequence without state"
    own = cast(ModelState, snap.state.clone())  # taken of a SeqState.v4 (`_snapshot`)
    assert own.num_tokens == snap.pos, (own.num_tokens, snap.pos)
    state.v4 = own
