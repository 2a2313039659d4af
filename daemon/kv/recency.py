"""The newest anchors of a prompt: where edits of a session's newest content land (ARCHITECTURE §5.3).

An agent's next request mostly rewrites what its last one ended with: the template drops the
reasoning of the assistant turns after the last user message once a new one arrives, clients drop
thinking blocks and rewrite the reminder of their latest user message, a tool output is replaced.
Each such edit resumes at one of a few anchors near the end of the previous prompt:

  turn-k                  the end of the prompt's k-th last turn (k = 1..TURNS)
  query                   the end of its last plain turn (no tool call, tool output or reasoning
                          inside: a user message), where the reasoning drop of a tool loop lands
  last:<kind>             the last anchor of every other kind within those turns (tool call /
                          tool output boundaries, end of thinking)

Besides these, every prompt keeps the end of its first turn (``first_turn_end``: the system
prompt, and the next turn's header where the family declares one), where a compaction or another
session of the same agent resumes.

Candidates closer than ``GAP`` tokens to a later kept one (or to the prompt's end, which has its
own snapshot: the session head) share its snapshot at the earlier position, so a turn end right
after ``</tool_call>`` costs one snapshot, not two. A prompt has at most about six of them; with
fewer recent snapshots than that, ``ranked`` says which go first.
"""

from __future__ import annotations

from collections.abc import Callable

TURNS = 4  # turn ends kept, newest first
GAP = 16  # tokens: anchors this close share one snapshot (the earliest of them)


def recent_anchors(
    tokens: list[int], end: int, kind_at: Callable[[list[int], int], str | None]
) -> dict[int, str]:
    """Position -> recency label of every candidate of ``tokens[:end]`` (before sharing)."""
    out: dict[int, str] = {}
    turns, turn_end, plain, inside = 0, 0, False, False
    seen: set[str] = set()
    # One pass from the end: a turn's inner anchors come before its end in reverse order.
    for pos in range(end, 0, -1):
        kind = kind_at(tokens, pos)
        if kind is None:
            continue
        if kind == "end_of_turn":
            if turns and not inside and not plain:  # the turn that ended after this one was plain
                out[turn_end] = "query"  # the more telling label of that turn end
                plain = True
            turns += 1
            turn_end, inside = pos, False
            if turns <= TURNS:
                out.setdefault(pos, f"turn-{turns}")
            elif plain:
                break
            continue
        inside = True
        if turns <= TURNS and kind not in seen:
            seen.add(kind)
            out.setdefault(pos, f"last:{kind}")
    if turns and not inside and not plain:  # the first turn of the prompt was plain
        out[turn_end] = "query"
    return out


def first_turn_end(
    tokens: list[int],
    end: int,
    kind_at: Callable[[list[int], int], str | None],
    after_header: Callable[[list[int], int], int | None] | None = None,
) -> int | None:
    """The end of the prompt's first turn (the system prompt): where a compaction, or another
    session of the same agent, resumes; None when the head's snapshot serves it. With
    ``after_header`` (the family's turn header), past the next turn's header when one follows:
    a compaction replaces that turn's content, not its role."""
    for pos in range(1, end - GAP):
        if kind_at(tokens, pos) == "end_of_turn":
            header = after_header(tokens, pos) if after_header is not None else None
            return header if header is not None and header < end - GAP else pos
    return None


def shared(candidates: dict[int, str], end: int) -> list[int]:
    """The positions that get a snapshot: the earliest of each run of candidates closer than
    ``GAP`` to each other, none within ``GAP`` before ``end`` (the head's snapshot serves)."""
    kept: list[int] = []
    for pos in sorted(candidates):
        if end - pos <= GAP:
            break
        if not kept or pos - kept[-1] > GAP:
            kept.append(pos)
    return kept


def ranked(
    candidates: dict[int, str], kept: list[int], learned: Callable[[str], bool], end: int
) -> list[int]:
    """``kept`` positions, most useful first: those serving a label the session's edits landed
    on, then the last user message, then turn ends and tool boundaries newest first, except
    that one followed only by a short last message (less than ``2 * GAP`` tokens to ``end``)
    ranks second: with a single recent snapshot, the anchor before the content that message
    follows (a tool output to replace, say) covers far more of the prompt."""

    def key(pos: int) -> tuple[int, int, int]:
        labels = cluster(candidates, pos, end)
        return (not any(learned(x) for x in labels), "query" not in labels, -pos)

    out = sorted(kept, key=key)
    if len(out) > 1 and end - out[0] < 2 * GAP and key(out[0])[:2] == key(out[1])[:2]:
        out[0], out[1] = out[1], out[0]
    return out


def cluster(candidates: dict[int, str], pos: int, end: int) -> list[str]:
    """Labels a snapshot at kept position ``pos`` serves (itself and the run after it, but not
    those within ``GAP`` before ``end``: the head's snapshot serves them)."""
    return [label for p, label in candidates.items() if pos <= p <= min(pos + GAP, end - GAP - 1)]
