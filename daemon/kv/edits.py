"""Where agents edit their context, learned online (DESIGN §2), to choose which snapshots to keep.

Coding agents edit old context at special-token boundaries and oldest-first: OpenCode replaces old
tool outputs by a placeholder (edits land on tool-output starts), SWE-agent elides observations
older than the last n (likewise), OpenClaw drops older thinking blocks (edits land just after an
end of turn). Each time a request leaves a cached path (an edit), the kind of the deepest snapshot
point before the edit is observed; the kinds that account for a fair share of recent edits are
the "edit kinds". After an edit, the first few snapshots of an edit kind are protected as the
session's edit frontier: the next edit lands there.
"""

from __future__ import annotations

from dataclasses import dataclass

from .snapshots import Snapshot


class EditModel:
    """Exponentially decayed counts of the snapshot kinds edits land on.

    Each session (a lineage of requests, each resuming from a snapshot of the one before) carries
    its own model, forked from the snapshot it resumed: two agents with different harnesses
    served side by side do not blur each other's pattern. A new session starts from the
    engine-wide model, scaled down (``PRIOR``) so that its own first edit outweighs it.
    """

    PRIOR = 0.25

    def __init__(self, decay: float = 0.8, share: float = 0.5) -> None:
        self.decay = decay  # weight of the past per observation
        self.share = share  # a kind is an edit kind with at least this share of the weight
        self.weights: dict[str, float] = {}

    def observe(self, kind: str) -> None:
        for k in self.weights:
            self.weights[k] *= self.decay
        self.weights[kind] = self.weights.get(kind, 0.0) + 1.0

    def admits(self, kind: str) -> bool:
        """Whether a snapshot of ``kind`` may be an edit frontier (any kind before any edit)."""
        if not self.weights:
            return True
        total = sum(self.weights.values())
        return self.weights.get(kind, 0.0) >= self.share * total

    def fork(self, scale: float = 1.0) -> EditModel:
        out = EditModel(self.decay, self.share)
        out.weights = {k: w * scale for k, w in self.weights.items()}
        return out


@dataclass
class Track:
    """Per request: the last snapshot on its path, its session's edit model, and how many
    frontier marks it may still give."""

    edits: EditModel
    parent: Snapshot | None = None
    frontier_left: int = 0
    frontier_after: int = 0  # only snapshots past this position (the edit) join the frontier
