"""Recency in the snapshot policy (ARCHITECTURE §5.3, kv/recency.py): an edit of a session's newest
content resumes at its anchor on its first occurrence, with the default settings; the recency
candidates of a prompt; the budget shared with the learned edit frontier."""

from __future__ import annotations

import pytest
import torch
from agent_sessions import MARKER_ANCHORS, MARKERS

from freetokend import LLM
from freetokend.engine.prefix import PrefixReuse, SnapshotPolicy
from freetokend.engine.sampler import SamplingParams
from freetokend.kv import recency
from freetokend.kv.edits import EditModel, Session
from freetokend.kv.pool import KVPool
from freetokend.kv.seq_state import RecurrentState, SeqState
from freetokend.kv.snapshots import prefix_key


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def serve(llm: LLM, prompt: list[int], gen: int = 3) -> tuple[list[int], int]:
    eng = llm.engine
    eng.add_request(f"r{id(prompt)}", prompt, SamplingParams(max_tokens=gen, ignore_eos=True))
    out, cached = [], -1
    while eng.has_unfinished():
        for o in eng.step():
            out.append(o.token_id)
            cached = o.num_cached_tokens
    return out, cached


def agent_conversation(system_words: int) -> list[dict[str, str]]:
    """System, user, assistant, a long tool output as a user message, user."""
    words = "cache page layer expert slot queue config request stream batch model shape".split()
    system = "You are a coding agent. " + " ".join(words[i % 12] for i in range(system_words))
    tool = "\n".join(f"    {words[i % 12]}_{words[i * 7 % 12]} = f({i})" for i in range(40))
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": "Fix the failing test in cache_page.py."},
        {"role": "assistant", "content": "I will read the file, then run the tests."},
        {"role": "user", "content": tool},
        {"role": "user", "content": "Go on."},
    ]


CHUNK = 512  # the default prefill chunk (max_step_tokens): its ends get snapshots for free


@pytest.mark.parametrize("snapshots", [None, 4, 2], ids=["default-budget", "4-snaps", "2-snaps"])
def test_replaced_last_tool_output_resumes_at_the_assistant_turn_end(builtin_model_dir, snapshots):
    """The issue's 5-message scenario: system, user, assistant, a long tool output as a user
    message, user; then the same with that tool output replaced by a placeholder. The first edit
    already resumes at the end of the assistant turn before it, with the default budget and with
    budgets of four and two snapshots of the model's state (cb254e1 resumed at the end of the
    first user turn: one of the two frontier snapshots; with two snapshots no recent anchor was
    kept at all)."""
    ref = LLM(builtin_model_dir, dtype="float32", prefix_cache=False)
    kwargs = {}
    if snapshots is not None:
        recurrent = ref.runner.new_state().recurrent
        assert recurrent is not None  # a hybrid model
        # half a snapshot of slack: the MB figure must not round the count down
        kwargs["snapshot_budget_mb"] = (snapshots + 0.5) * recurrent.nbytes / 2**20
    llm = LLM(builtin_model_dir, dtype="float32", **kwargs)  # default policy and chunking
    if snapshots is not None:
        store = llm.engine.prefix.snapshots
        assert store.budget // recurrent.nbytes == snapshots
    msgs = agent_conversation(240)
    edited = [*msgs[:3], {"role": "user", "content": "[Old tool result content cleared]"}, msgs[4]]
    first, second = (
        llm.tokenizer.encode(llm.chat_template.render(m, add_generation_prompt=True))
        for m in (msgs, edited)
    )
    eot = llm.tokenizer.token_to_id("<|im_end|>")
    anchor = [i + 1 for i, t in enumerate(second) if t == eot][2]  # end of the assistant turn
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert anchor < common < anchor + 8  # the edit lands right after the assistant turn
    # no chunk end near the anchor: only a snapshot of the anchor itself can pass
    assert all(p % CHUNK for p in range(anchor - 2, anchor + 1)) and len(first) > CHUNK
    serve(llm, first)
    out, cached = serve(llm, second)
    assert anchor - 2 <= cached <= anchor, (cached, anchor, len(second))
    assert out == serve(ref, second)[0]  # fp32: reuse does not change the output


def test_a_compaction_resumes_after_the_next_turns_header(builtin_model_dir):
    """A compaction (OpenCode's, issue 46) keeps the system prompt and replaces the rest: the
    first user message's content is the first difference. The system prompt's snapshot is taken
    after the header that opens the next turn (``<|im_start|>user\n``), so the compacted
    prompt resumes at the difference itself, not a few tokens before it at ``<|im_end|>``."""
    ref = LLM(builtin_model_dir, dtype="float32", prefix_cache=False)
    llm = LLM(builtin_model_dir, dtype="float32")  # default policy, budget and chunking
    msgs = agent_conversation(600)
    compacted = [
        msgs[0],
        {"role": "user", "content": "What did we do so far?"},
        {"role": "assistant", "content": "We read cache_page.py; the tests still fail."},
        {"role": "user", "content": "Continue if you have next steps."},
    ]
    first, second = (
        llm.tokenizer.encode(llm.chat_template.render(m, add_generation_prompt=True))
        for m in (msgs, compacted)
    )
    eot = llm.tokenizer.token_to_id("<|im_end|>")
    system_end = first.index(eot) + 1
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert system_end + 2 < common < system_end + 8  # the edit lands after the user header
    # no chunk end there: only a snapshot of the header's end can serve it
    assert all(p % CHUNK for p in range(system_end, common + 1)) and system_end > CHUNK
    serve(llm, first)
    out, cached = serve(llm, second)
    assert cached == common, (cached, common, system_end)
    assert out == serve(ref, second)[0]  # fp32: reuse does not change the output


def test_the_turn_header_is_found_only_right_after_a_turn_end():
    start, end, eot = 7, 8, 9
    policy = SnapshotPolicy({eot: "end_of_turn"}, turn_header=(start, end))
    tokens = [1, 2, eot, 3, start, 4, 5, end, 6, 6]
    assert policy.after_header(tokens, 3) == 8  # "\n" <|im_start|> u ser "\n": content at 8
    assert policy.after_header(tokens, 2) is None  # the opening token too far
    assert policy.after_header([1, eot, 3, start, *[4] * 9, end], 2) is None  # header too long
    assert SnapshotPolicy({eot: "end_of_turn"}).after_header(tokens, 3) is None  # no header
    tokens += [6] * 40
    assert recency.first_turn_end(tokens, len(tokens), policy.kind_at, policy.after_header) == 8
    assert recency.first_turn_end(tokens, len(tokens), policy.kind_at) == 3
    assert recency.first_turn_end(tokens, 20, policy.kind_at, policy.after_header) == 3  # too near


def _chatml(*turns: list[int]) -> list[int]:
    """Token-level ChatML: each turn is <|im_start|> body <|im_end|> (marker ids of agent_sessions)."""
    out: list[int] = []
    for body in turns:
        out += [MARKERS["<|im_start|>"], *body, MARKERS["<|im_end|>"]]
    return out


def test_recent_anchors_of_a_tool_loop():
    policy = SnapshotPolicy.parse("anchors", dict(MARKER_ANCHORS))
    m, w = MARKERS, list(range(20, 60))  # w: plain words
    call = [m["<tool_call>"], *w[:30], m["</tool_call>"]]
    output = [m["<tool_response>"], *w[:30], m["</tool_response>"]]
    think = [m["<think>"], *w[:20], m["</think>"]]
    toks = _chatml(w[:30], w[:30], think + call, output, think + call, output) + [2, 30]
    ends = [i + 1 for i, t in enumerate(toks) if t == m["<|im_end|>"]]
    cands = recency.recent_anchors(toks, len(toks), policy.kind_at)
    assert cands[ends[-1]] == "turn-1" and cands[ends[-2]] == "turn-2"
    assert cands[ends[1]] == "query"  # the user message before the tool loop
    assert cands[ends[-1] - 1] == "last:tool_output_end"
    assert cands[toks.index(m["</think>"], ends[3]) + 1] == "last:end_of_thinking"
    assert ends[0] not in cands  # the fifth turn end from the end, and not plain-last
    kept = recency.shared(cands, len(toks))
    assert ends[-1] not in kept and ends[-1] - 1 not in kept  # the head's snapshot serves
    assert ends[-2] - 1 in kept and ends[-2] not in kept  # </tool_call><|im_end|>: one snapshot
    assert set(recency.cluster(cands, ends[-2] - 1, len(toks))) >= {"turn-2", "last:tool_call_end"}


def test_a_session_keeps_the_recent_anchors_its_edits_land_on():
    m = EditModel()
    assert m.admits_recent("turn-3") and m.admits_recent("query")  # before its own first edit
    prior = m.fork(EditModel.PRIOR)
    prior.observe("tool_output_start")  # another session's habit, inherited lightly ...
    fresh = prior.fork(EditModel.PRIOR)
    assert fresh.admits_recent("turn-2")  # ... does not cost a new session its recency
    for _ in range(3):
        fresh.observe("turn-2")
    assert fresh.admits_recent("turn-2") and not fresh.admits_recent("turn-4")
    assert not fresh.admits("tool_output_start")  # its frontier gives way to recency
    assert m.recent_share() == 0.5  # before its first edit: half the spare snapshots each
    assert fresh.recent_share() > 0.9  # its edits land on recent anchors: recency takes most
    pruner = EditModel()
    for _ in range(3):
        pruner.observe("tool_output_start")  # oldest-first pruning: the frontier takes them
    assert pruner.recent_share() == 0.0


def _state(n: int = 8) -> RecurrentState:
    return RecurrentState(torch.zeros(1, n, 1), torch.zeros(1, 1, n, 1))


def test_recent_marks_follow_the_session_and_protect_within_the_budget():
    """A toy hybrid engine (no model): prompts snapshot their recent anchors, the next prompt
    of the session demotes the previous prompt's recent snapshots it no longer needs, and its
    edit of the newest turn resumes at the anchor with a budget of five snapshots (head, system
    prompt end, two recent anchors, one frontier)."""
    pool = KVPool(1, 64, 16, 1, 2)
    policy = SnapshotPolicy.parse("anchors", dict(MARKER_ANCHORS))
    reuse = PrefixReuse(pool, True, policy, 5 * _state().nbytes)
    w = list(range(20, 60))
    base = _chatml(w[:20], w[:10], w[5:30])  # system, user, assistant

    def prompt_with(tail: list[int]) -> list[int]:
        return base + _chatml(tail, w[:20]) + [2, 30]

    def run(tokens: list[int]) -> int:
        st = SeqState(recurrent=_state())
        got = reuse.restore(tokens, st)
        pages_needed = -(-len(tokens) // 16) - len(st.pages)
        st.pages += pool.alloc(pages_needed)
        while st.num_tokens < len(tokens):  # one "forward" per chunk, as the engine plans it
            st.num_tokens = reuse.chunk_end(tokens, st.num_tokens, len(tokens), st)
            st.recurrent.ssm.fill_(st.num_tokens)  # the state records where it was taken
            reuse.after_forward(tokens, st, len(tokens))
        reuse.release(tokens, st)
        pool.free(st.pages)
        return got

    first = prompt_with(w[:30])  # a long tool output as a user message
    assert run(first) == 0
    anchor = len(base)
    edited = prompt_with([7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19])  # ... a placeholder
    assert run(edited) == anchor
    snaps = {s.pos: s for s in reuse.snapshots.snapshots()}
    assert len(snaps) <= 5
    assert snaps[anchor].recent and int(snaps[anchor].state.ssm[0, 0, 0, 0]) == anchor
    stale = [s for s in snaps.values() if s.key != prefix_key(edited, s.pos)]
    assert not any(s.recent for s in stale)  # the first prompt's tail: demoted


@pytest.mark.parametrize(
    ("held", "before", "recent_edits", "pruning"),
    [
        # snapshots the budget holds: (recent, root, frontier) before the first edit, after
        # edits on recent anchors only, after oldest-first pruning edits only
        (1, (0, False, 0), (0, False, 0), (0, False, 0)),
        (2, (1, False, 0), (0, True, 0), (0, True, 0)),
        (3, (2, False, 0), (1, True, 0), (0, True, 1)),
        (4, (2, True, 0), (2, True, 0), (0, True, 2)),
        (8, (3, True, 3), (6, True, 0), (0, True, 6)),
    ],
)
def test_the_budget_split(held, before, recent_edits, pruning):
    """Besides the head: two recent anchors until the session's first edit, then the system
    prompt's end, then the rest by the share of the session's edits on recent anchors."""
    pool = KVPool(1, 64, 16, 1, 2)
    policy = SnapshotPolicy.parse("anchors", dict(MARKER_ANCHORS))
    reuse = PrefixReuse(pool, True, policy, held * _state().nbytes)
    st = SeqState(recurrent=_state())
    fresh, edits_recent, pruner = EditModel(), EditModel(), EditModel()
    for _ in range(3):
        edits_recent.observe("turn-2")
        pruner.observe("tool_output_start")
    got = [reuse._shares(Session(m), st) for m in (fresh, edits_recent, pruner)]
    assert got == [before, recent_edits, pruning]
    interval_policy = SnapshotPolicy.parse("interval:64", {})
    interval = PrefixReuse(pool, True, interval_policy, held * _state().nbytes)
    assert interval._shares(Session(fresh), st) == (0, False, max(0, held - 1))  # no anchors


def test_a_short_last_message_ranks_its_turn_end_second():
    """With one recent snapshot, the turn end before a long last tool output beats the turn end
    right before a short last message ("Go on."), whose query label the head serves."""
    cands = {100: "turn-3", 900: "turn-2", 911: "query"}
    end = 922
    kept = recency.shared(cands, end)
    assert kept == [100, 900]
    assert recency.cluster(cands, 900, end) == ["turn-2"]  # not the head's query
    assert recency.ranked(cands, kept, lambda label: False, end) == [100, 900]
    # a last message of 100 tokens (Claude Code's reminder, say): newest first
    turns = {100: "turn-3", 900: "turn-2"}
    assert recency.ranked(turns, kept, lambda label: False, 1000) == [900, 100]
    learned = lambda label: label == "turn-2"  # noqa: E731
    assert recency.ranked(cands, kept, learned, end) == [900, 100]  # the session's own edits


def test_an_edit_is_labelled_on_the_sessions_own_path_not_anothers():
    """Claude Code moves its reminder out of the first user message at its second request: the
    edit lands inside that message, at the session's own system prompt end (a recent anchor).
    Another session with the same start cached a path past that message's end; the label must
    still be the session's recent anchor, not the deeper turn end of the other's path (which
    taught the session that its edits land on old content and cost it its recent anchors)."""
    pool = KVPool(1, 256, 16, 1, 2)
    policy = SnapshotPolicy.parse("anchors", dict(MARKER_ANCHORS))
    reuse = PrefixReuse(pool, True, policy, 4 * _state().nbytes)
    w = list(range(20, 60))

    def run(tokens: list[int]) -> None:
        st = SeqState(recurrent=_state())
        reuse.restore(tokens, st)
        st.pages += pool.alloc(-(-len(tokens) // 16) - len(st.pages))
        while st.num_tokens < len(tokens):
            st.num_tokens = reuse.chunk_end(tokens, st.num_tokens, len(tokens), st)
            reuse.after_forward(tokens, st, len(tokens))
        reuse.release(tokens, st)
        pool.free(st.pages)

    system, task, reminder = w[:30], w[5:25], w[30:40] * 3
    # another agent, same start: its snapshots are its head, root and two newest turn ends
    other = _chatml(system, task, w[:30], w[10:40], w[:25], w[3:33]) + [2, 30]
    run(other)
    run(_chatml(system, task + reminder) + [2, 30])  # the reminder in the first user message
    second = _chatml(system, task, w[1:31], w[2:32], reminder) + [2, 30]
    run(second)
    head = next(s for s in reuse.snapshots.snapshots() if s.head and s.pos == len(second))
    weights = head.session.edits.weights
    assert head.session.edits.own == 1
    assert set(weights) == {"turn-2"}, weights  # the system prompt's end, second turn from last
