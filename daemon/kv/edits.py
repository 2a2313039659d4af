"""Where agents edit their context, learned online (ARCHITECTURE §5.3), to choose which snapshots to keep.

Edits land at both ends of an agent's context:

- on the NEWEST content: chat templates drop the reasoning of the previous assistant turns when a
  user message arrives (Qwen3 / Qwen3.5), Anthropic-style clients drop earlier thinking blocks and
  Claude Code rewrites the ``<system-reminder>`` of its latest user message; a client may replace
  the last tool output. These land on one of the last few anchors of the session's previous
  prompt (kv/recency.py names them: ``turn-2`` is the end of its second-to-last turn, ``query``
  the end of its last plain user message, ``last:tool_output_start``...);
- on the OLDEST content: OpenCode prunes old tool outputs (oldest first), SWE-agent elides
  observations older than the last n. These land on the first anchors after the previous edit.

Each time a request leaves a cached path (an edit), the deepest snapshot point before the edit is
observed: as its recency label when it was one of the previous prompt's recent anchors, else as
its anchor kind. A session then keeps the recent anchors whose labels have a fair share of its
edits (all of them until its own first edit, when the budget keeps two) and protects as its edit
frontier the first snapshots past an edit whose kind has a fair share, each within the part of
the budget the share of its edits on recent anchors gives it (``recent_share``). So a session
that edits its newest content spends its snapshots on recency, one that prunes oldest-first on
the frontier, and a mixed one on both, in proportion (the snapshot store's budget rule is in
kv/snapshots.py).

This module depends on nothing else in ``kv``; the snapshot store refers to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RECENT_PREFIXES = ("turn-", "query", "last:")  # the recency labels of kv/recency.py


class EditModel:
    """Exponentially decayed counts of the labels (recency labels or anchor kinds) edits land on.

    Each session (a lineage of requests, each resuming from a snapshot of the one before) carries
    its own model, forked from the snapshot it resumed: two agents with different harnesses
    served side by side do not blur each other's pattern. A new session starts from the
    engine-wide model, scaled down (``PRIOR``) so that its own first edit outweighs it; recency
    is judged on the session's own edits only (``own``), so a fresh session keeps its newest
    anchors whatever other sessions taught.
    """

    PRIOR = 0.25

    def __init__(self, decay: float = 0.8, share: float = 0.5) -> None:
        self.decay = decay  # weight of the past per observation
        self.share = share  # a kind is an edit kind with at least this share of the weight
        self.weights: dict[str, float] = {}
        self.own = 0  # observations of this session itself (not inherited from the prior)

    def observe(self, label: str) -> None:
        for k in self.weights:
            self.weights[k] *= self.decay
        self.weights[label] = self.weights.get(label, 0.0) + 1.0
        self.own += 1

    def admits(self, kind: str) -> bool:
        """Whether a snapshot of ``kind`` may be an edit frontier (any kind before any edit)."""
        if not self.weights:
            return True
        total = sum(self.weights.values())
        return self.weights.get(kind, 0.0) >= self.share * total

    def admits_recent(self, label: str) -> bool:
        """Whether the recent anchor ``label`` is worth keeping: always until the session's own
        first edit, then when it drew at least half a fair share of the session's edits (two
        alternating patterns both stay)."""
        if not self.own:
            return True
        total = sum(self.weights.values())
        return self.weights.get(label, 0.0) >= self.share / 2 * total

    def recent_share(self) -> float:
        """The share of the session's own edits that landed on recent anchors (one half until
        its first edit): the part of the spare snapshots its recency gets."""
        if not self.own:
            return 0.5
        total = sum(self.weights.values())
        recent = sum(w for k, w in self.weights.items() if k.startswith(RECENT_PREFIXES))
        return recent / total if total else 0.5

    def fork(self, scale: float = 1.0) -> EditModel:
        """A copy for the next request of the session (``scale`` 1), or the prior of a new one."""
        out = EditModel(self.decay, self.share)
        out.weights = {k: w * scale for k, w in self.weights.items()}
        out.own = self.own if scale == 1.0 else 0
        return out


@dataclass
class Session:
    """What a request knows of its session: the edit model, and the recent anchors of its prompt.

    ``recent`` maps each recency candidate of the prompt (kv/recency.py) to its label, so the next
    request of the session can tell which one its edit landed on; ``recent_keys`` are the prefix
    keys of the snapshots this request marked recent, demoted when the session moves on.
    """

    edits: EditModel
    recent: dict[int, str] = field(default_factory=dict)
    recent_keys: list[bytes] = field(default_factory=list)
    head_key: bytes = b""  # the prefix key of the head snapshot this request took
    prompt_end: int = 0  # the length of this request's prompt
    # the positions of its prompt's anchors: the next request's edit is labelled at the deepest
    # of them still on its path (the cached path may go deeper: another session's prompt)
    anchors: frozenset[int] = frozenset()

    successor: Session | None = None  # the session of the next request of this lineage

    def latest(self) -> Session:
        """The newest request's session of this lineage (a snapshot keeps the session of the
        request that took it, which later requests of the same agent follow)."""
        s = self
        while s.successor is not None:
            s = s.successor
        if self.successor is not None:
            self.successor = s  # shortcut: the sessions between need not stay alive
        return s

    def next(self) -> Session:
        """The session as the next request of it starts: same habits, no anchors yet."""
        self.successor = Session(self.edits.fork())
        return self.successor
