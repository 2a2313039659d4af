"""The scripted harnesses of the agent replay benchmark (tests/agent_harnesses.py) edit their
context the way the real clients do: rendering and message lists only, no model."""

from __future__ import annotations

import json

from agent_harnesses import (
    OPENAI_TOOLS,
    PLACEHOLDER,
    QWEN3_TEMPLATE,
    Harness,
    make_script,
)

from freetokend.engine.chat_template import ChatTemplate

TURNS = 12


def pruned(msgs: list[dict]) -> list[str]:
    """tool_call_id of every tool message whose output was pruned."""
    return [m["tool_call_id"] for m in msgs if m["role"] == "tool" and m["content"] == PLACEHOLDER]


def test_opencode_prunes_oldest_outputs_past_its_threshold_and_stays_pruned():
    script = make_script(TURNS, seed=3)
    h = Harness("opencode", script)
    history = [pruned(h.messages(t)) for t in range(TURNS + 1)]
    first = next(t for t, p in enumerate(history) if p)
    # Before pruning fires, the unprotected outputs (all but the last two steps) stay under the
    # threshold or would free too little; once it fires, it frees at least the minimum.
    before = sum(len(s.output) for s in script[: first - 3])
    assert before <= h.prune_protect + h.prune_minimum
    assert first >= 3
    freed = sum(len(script[int(c.split("_")[1])].output) for c in history[first])
    assert freed >= h.prune_minimum
    ids = [int(c.split("_")[1]) for c in history[first]]
    assert ids == list(range(len(ids)))  # oldest first
    assert max(ids) < first - 2  # the last two steps are protected
    for t in range(first, TURNS):  # sticky: a pruned output never comes back
        assert set(history[t]) <= set(history[t + 1])
    assert len(history[TURNS]) > len(history[first])  # and it prunes again as the context grows
    msgs = h.messages(TURNS)
    assert all("reasoning_content" not in m for m in msgs)  # OpenCode sends no reasoning back


def test_claude_code_compacts_drops_thinking_and_rewrites_its_reminder():
    h = Harness("claude-code", make_script(TURNS, seed=2))
    seq = [h.messages(t) for t in range(TURNS + 1)]
    compacted = [t for t in range(TURNS + 1) if "Summary:" in str(seq[t][1]["content"])]
    assert compacted and compacted == list(range(compacted[0], TURNS + 1))  # sticky
    c = compacted[0]
    assert len(seq[c]) < len(seq[c - 1])  # the history is replaced by a summary
    assert "Summary:" not in str(seq[c - 1][1]["content"])
    for t in range(1, TURNS + 1):
        msgs = seq[t]
        thinking = [i for i, m in enumerate(msgs) if m.get("reasoning_content")]
        assistants = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        assert thinking == assistants[-1:]  # thinking kept on the last assistant message only
        assert "<system-reminder>" in str(msgs[-1]["content"])
        earlier = " ".join(str(m.get("content")) for m in msgs[:-1])
        assert "<system-reminder>" not in earlier  # the previous reminder is gone
    assert all("billing" not in str(m["content"]) for m in seq[3])  # the daemon drops it


def test_sweagent_elides_observations_older_than_the_last_five():
    h = Harness("sweagent", make_script(TURNS, seed=5))
    msgs = h.messages(TURNS)
    obs = [m["content"] for m in msgs if m["role"] == "tool"]
    assert len(obs) == TURNS
    assert all(o.startswith("Old environment output") for o in obs[: TURNS - h.keep_obs])
    assert [o for o in obs[TURNS - h.keep_obs :]] == [s.output for s in h.script[-h.keep_obs :]]


def test_qwen3_render_drops_reasoning_before_the_last_user_message():
    script = make_script(TURNS, seed=1, follow_every=4)
    h = Harness("qwen", script)
    template = ChatTemplate({"default": QWEN3_TEMPLATE})

    def render(t: int) -> str:
        return template.render(h.messages(t), tools=OPENAI_TOOLS, add_generation_prompt=True)

    # Step 4 ends with a user follow-up: request 4's prompt has it last, request 6 two steps more.
    four, six = render(4), render(6)
    assert script[3].follow_up and script[3].follow_up in four
    assert all(s.reasoning not in four for s in script[:4])  # all before the last user message
    assert all(s.reasoning not in six for s in script[:4])
    assert all(s.reasoning in six for s in script[4:6])  # after it: kept
    three = render(3)
    assert all(s.reasoning in three for s in script[:3])  # no follow-up yet: all kept
    # The follow-up rewrote the turns after the previous user message: not a prefix any more.
    assert not four.startswith(three.removesuffix("<|im_start|>assistant\n"))
    assert six.startswith(render(5).removesuffix("<|im_start|>assistant\n"))  # append-only
    assert "<tools>" in four and json.dumps(OPENAI_TOOLS[0]) in four


def test_codex_is_append_only_with_reasoning():
    h = Harness("codex", make_script(TURNS, seed=4))
    seq = [h.messages(t) for t in range(TURNS + 1)]
    for t in range(TURNS):
        assert seq[t + 1][: len(seq[t])] == seq[t]  # every request resends the whole history
    assistants = [m for m in seq[TURNS] if m["role"] == "assistant"]
    assert len(assistants) == TURNS and all(m.get("reasoning_content") for m in assistants)
    users = [m for m in seq[TURNS] if m["role"] == "user"]
    assert any("whole test module" in str(m["content"]) for m in users)  # the midway instruction
