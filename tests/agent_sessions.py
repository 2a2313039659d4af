"""Scripted coding-agent sessions in the three context-editing styles of ARCHITECTURE §5.3.

A session is a fixed script of turns (the assistant's reasoning and tool call, then the tool's
output), drawn from a seeded generator. What the agent SENDS at turn t is the history up to t,
edited the way its harness edits context:

  opencode   compaction: every ``every`` turns, tool outputs older than the last ``keep`` are
             replaced by a placeholder (and stay replaced)
  openclaw   thinking of older assistant turns is dropped; the last ``keep`` keep theirs
  sweagent   only the last ``keep`` observations are shown; older ones are elided

``messages(t)`` gives the OpenAI-style message list of turn t (tools, tool calls, tool results,
reasoning), to render through a model's chat template. Used by tests/test_prefix_reuse.py; the
replay benchmark scripts real harnesses instead (tests/agent_harnesses.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

STYLES = ("opencode", "openclaw", "sweagent")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
    for name, desc in (
        ("read_file", "Read a file of the repository."),
        ("run_tests", "Run the test suite under a path."),
        ("grep", "Search the repository for a pattern."),
    )
]

_WORDS = (
    "self value index count buffer result error token state cache page layer expert slot queue "
    "config request stream batch model shape offset length parser handle limit window budget"
).split()


def _code_line(rng: random.Random) -> str:
    a, b, c = rng.sample(_WORDS, 3)
    form = rng.randrange(4)
    if form == 0:
        return f"    {a}_{b} = {c}.{rng.choice(_WORDS)}({rng.randint(0, 99)})"
    if form == 1:
        return f"    if {a} > {b}_{c}:\n        return {rng.choice(_WORDS)}"
    if form == 2:
        return f"def {a}_{b}({c}, {rng.choice(_WORDS)}):"
    return f"# {a} {b} {c} {rng.choice(_WORDS)}"


@dataclass(frozen=True)
class TurnScript:
    reasoning: str
    tool: str
    path: str
    output: str


@dataclass
class AgentSession:
    """One scripted session; ``messages(t)`` is what the agent sends before assistant turn t."""

    style: str
    turns: list[TurnScript]
    keep: int = 3
    every: int = 4
    task: str = "Fix the failing test in the cache module."
    system: str = "You are a careful coding agent. Use the tools."

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {self.style!r}")

    def _opencode_cut(self, t: int) -> int:
        """Tool outputs of turns < cut are compacted when turn t is sent (batched, sticky)."""
        return max(0, (t // self.every) * self.every - self.keep) if t >= self.every else 0

    def messages(self, t: int) -> list[dict[str, Any]]:
        """History before assistant turn ``t`` (0 = only the task), edited per the style."""
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.task},
        ]
        for i, turn in enumerate(self.turns[:t]):
            keep_thinking = self.style != "openclaw" or i >= t - self.keep
            msg: dict[str, Any] = {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": turn.tool, "arguments": {"path": turn.path}},
                    }
                ],
            }
            if keep_thinking:
                msg["reasoning_content"] = turn.reasoning
            msgs.append(msg)
            msgs.append({"role": "tool", "content": self._observation(t, i, turn)})
        return msgs

    def _observation(self, t: int, i: int, turn: TurnScript) -> str:
        if self.style == "opencode" and i < self._opencode_cut(t):
            return "[Old tool result content cleared]"
        if self.style == "sweagent" and i < t - self.keep:
            return f"Old environment output: ({turn.output.count(chr(10)) + 1} lines omitted)"
        return turn.output


def make_session(
    style: str, num_turns: int, seed: int, output_lines: int = 40, keep: int = 3, every: int = 4
) -> AgentSession:
    """A session of ``num_turns`` turns; each tool output has about ``output_lines`` lines."""
    rng = random.Random(seed)
    turns = []
    for _ in range(num_turns):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(12, 30)))
        tool = rng.choice([t["function"]["name"] for t in TOOLS])
        path = f"src/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py"
        n = rng.randint(output_lines // 2, output_lines * 3 // 2)
        output = "\n".join(_code_line(rng) for _ in range(n))
        turns.append(TurnScript(f"The {words} looks wrong; check {path}.", tool, path, output))
    task = f"Fix the failing test in {rng.choice(_WORDS)}_{rng.choice(_WORDS)}.py: {' '.join(rng.sample(_WORDS, 6))}."
    return AgentSession(style, turns, keep=keep, every=every, task=task)


# ---- token-level rendering, for models without a tokenizer (tests/tiny_models.py) -------------

# Marker tokens of the token-level rendering (ids 2..9; 0 and 1 are bos / eos of the tiny models).
MARKERS = {
    "<|im_start|>": 2,
    "<|im_end|>": 3,
    "<think>": 4,
    "</think>": 5,
    "<tool_call>": 6,
    "</tool_call>": 7,
    "<tool_response>": 8,
    "</tool_response>": 9,
}
# The anchor kinds of the markers (as the ChatML family table names them).
MARKER_ANCHORS = {
    3: "end_of_turn",
    5: "end_of_thinking",
    6: "tool_call_start",
    7: "tool_call_end",
    8: "tool_output_start",
    9: "tool_output_end",
}


def _word_ids(text: str, vocab: int) -> list[int]:
    """A stable stand-in tokenizer: one id per whitespace-separated word, above the markers."""
    import zlib

    return [10 + zlib.crc32(w.encode()) % (vocab - 10) for w in text.split()]


def render_tokens(messages: list[dict[str, Any]], vocab: int) -> list[int]:
    """ChatML-shaped token ids of ``messages`` plus the generation prompt (no template engine)."""
    m, out = MARKERS, []
    for msg in messages:
        role = msg["role"] if msg["role"] != "tool" else "user"
        out += [m["<|im_start|>"], *_word_ids(role, vocab)]
        if msg.get("reasoning_content") is not None:
            out += [m["<think>"], *_word_ids(msg["reasoning_content"], vocab), m["</think>"]]
        out += (
            _word_ids(msg.get("content") or "", vocab)
            if msg["role"] != "tool"
            else [m["<tool_response>"], *_word_ids(msg["content"], vocab), m["</tool_response>"]]
        )
        for call in msg.get("tool_calls") or []:
            fn = call["function"]
            out += [
                m["<tool_call>"],
                *_word_ids(f"{fn['name']} {fn['arguments']}", vocab),
                m["</tool_call>"],
            ]
        out.append(m["<|im_end|>"])
    return out + [m["<|im_start|>"], *_word_ids("assistant", vocab)]
