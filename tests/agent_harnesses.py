"""Coding-agent sessions as real harnesses send them, for the snapshot-policy benchmark (ARCHITECTURE §5.3).

One seeded task script (the assistant's reasoning, tool calls, realistic tool outputs, the user's
follow-up instructions) is replayed by five harnesses, each editing its context the way the real
client does (../shared/CLIENTS.md for the wire formats):

  qwen         OpenAI chat, reasoning sent back as ``reasoning_content``; the user adds an
               instruction every few steps. Qwen3-family templates drop the reasoning of every
               assistant turn before the last user message: each new user message rewrites the
               tool loop since the previous one.
  claude-code  Anthropic Messages: system blocks (a billing line whose suffix changes), thinking
               blocks kept on the last assistant message only, a ``<system-reminder>`` in the
               latest user message (rewritten away at the next request), and a compaction
               (summary replaces the history) once the context passes a threshold.
  opencode     OpenAI chat, ``content: ""`` plus ``tool_calls``, no reasoning sent back; once the
               tool outputs pass a token threshold, the oldest outside the protected last turns
               are replaced by a placeholder (sticky).
  codex        OpenAI Responses, the full history resent each time (append-only) with reasoning
               items; the user adds one instruction midway.
  sweagent     OpenAI chat with function calls; observations older than the last five are
               elided.

``messages(t)`` gives the template messages of request ``t`` (t completed steps), converted from
the harness's own payload by the daemon's own request converters for Anthropic and Responses.
``QWEN3_TEMPLATE`` renders them as Qwen3's chat template does (written from its documented
behaviour); the built-in model's own template (no reasoning drop) is the other choice.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import msgspec
from agent_sessions import _WORDS, _code_line

HARNESSES = ("qwen", "claude-code", "opencode", "codex", "sweagent")
PLACEHOLDER = "[Old tool result content cleared]"


def _tool(name: str, desc: str, **props: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": desc,
        "parameters": {
            "type": "object",
            "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
            "required": list(props),
        },
    }


TOOLS = [
    _tool("read", "Read a file of the repository; returns numbered lines.", path="File path"),
    _tool("bash", "Run a shell command in the repository and return its output.", command="Cmd"),
    _tool("grep", "Search the repository for a regular expression.", pattern="Regex", path="Dir"),
    _tool("edit", "Replace a unique string in a file.", path="File", old="Old", new="New"),
]
OPENAI_TOOLS = [{"type": "function", "function": t} for t in TOOLS]


@dataclass(frozen=True)
class Step:
    reasoning: str
    text: str  # assistant text before its call ("" mostly)
    tool: str
    args: dict[str, str]
    output: str
    follow_up: str | None  # a user instruction after this step's output


def make_script(steps: int, seed: int, lines: int = 60, follow_every: int = 4) -> list[Step]:
    """``steps`` steps whose tool outputs have about ``lines`` lines (hundreds to thousands of
    tokens); a user follow-up after every ``follow_every``-th step."""
    rng = random.Random(seed)
    out = []
    for i in range(steps):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 60)))
        tool = rng.choice(["read", "bash", "grep", "read"])
        path = f"src/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py"
        args = {"read": {"path": path}, "bash": {"command": f"pytest -x {path}"}}.get(
            tool, {"pattern": rng.choice(_WORDS), "path": "src"}
        )
        n = rng.randint(lines // 3, lines * 5 // 3)
        output = "\n".join(f"{j + 1:5d}  {_code_line(rng)}" for j in range(n))
        text = f"Let me look at {path}." if rng.random() < 0.3 else ""
        follow = None
        if (i + 1) % follow_every == 0:
            follow = f"Also keep {rng.choice(_WORDS)}_{rng.choice(_WORDS)} working, and be brief."
        out.append(
            Step(f"The {words} looks wrong; check {path}.", text, tool, args, output, follow)
        )
    return out


SYSTEM = (
    "You are an interactive coding agent working in a git repository. Use the tools to read, "
    "search and run code; make minimal, correct edits; keep answers short. "
    + " ".join(f"Rule {i}: {' '.join(_WORDS[i : i + 12])}." for i in range(12))
)
TASK = "The test tests/test_cache.py::test_evict fails after the last refactor. Fix it."


@dataclass
class Harness:
    """What ``name``'s client sends at each request of a scripted session."""

    name: str
    script: list[Step]
    compact_at: int = 16000  # claude-code: compaction past this many characters of history
    prune_protect: int = 6000  # opencode: characters of recent tool output never pruned
    prune_minimum: int = 3000  # opencode: prune only when it frees at least this much
    keep_obs: int = 5  # sweagent: observations shown

    def __post_init__(self) -> None:
        if self.name not in HARNESSES:
            raise ValueError(f"harness must be one of {HARNESSES}, got {self.name!r}")
        self._pruned: set[int] = set()  # opencode: steps whose output is pruned (sticky)
        self._compacted = 0  # claude-code: steps folded into the summary (sticky)

    def messages(self, t: int) -> list[dict[str, Any]]:
        """Template messages of request ``t`` (call with t = 0, 1, 2, ... in order)."""
        return getattr(self, "_" + self.name.replace("-", "_"))(t)

    # ---- OpenAI chat harnesses ------------------------------------------------------------
    def _chat(self, t: int, reasoning: bool, text: bool, output: Any) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": TASK},
        ]
        for i, s in enumerate(self.script[:t]):
            call = {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": s.tool, "arguments": json.dumps(s.args)},
            }
            msg: dict[str, Any] = {"role": "assistant", "content": s.text if text else ""}
            msg["tool_calls"] = [call]
            if reasoning:
                msg["reasoning_content"] = s.reasoning
            msgs.append(msg)
            msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": output(t, i, s)})
            if s.follow_up and reasoning:  # the qwen harness's user types between steps
                msgs.append({"role": "user", "content": s.follow_up})
        return msgs

    def _qwen(self, t: int) -> list[dict[str, Any]]:
        return self._chat(t, True, True, lambda t, i, s: s.output)

    def _opencode(self, t: int) -> list[dict[str, Any]]:
        self._prune(t)
        return self._chat(
            t, False, False, lambda t, i, s: PLACEHOLDER if i in self._pruned else s.output
        )

    def _prune(self, t: int) -> None:
        """Newest first, past the last two steps: outputs beyond ``prune_protect`` characters
        are pruned when that frees at least ``prune_minimum`` (OpenCode's rule, scaled)."""
        total, freed, victims = 0, 0, []
        for i in range(t - 3, -1, -1):
            if i in self._pruned:
                break  # everything older is pruned already
            size = len(self.script[i].output)
            total += size
            if total > self.prune_protect:
                victims.append(i)
                freed += size
        if freed >= self.prune_minimum:
            self._pruned.update(victims)

    def _sweagent(self, t: int) -> list[dict[str, Any]]:
        def obs(t: int, i: int, s: Step) -> str:
            if i < t - self.keep_obs:
                return f"Old environment output: ({s.output.count(chr(10)) + 1} lines omitted)"
            return s.output

        return self._chat(t, False, True, obs)

    # ---- Anthropic Messages: Claude Code ----------------------------------------------------
    def _claude_code(self, t: int) -> list[dict[str, Any]]:
        from freetokend.server.routes.anthropic import convert_messages
        from freetokend.server.schemas.anthropic import CountTokensRequest

        body = self._claude_body(t)
        if sum(len(json.dumps(m)) for m in body["messages"]) > self.compact_at:
            self._compacted = t  # the client summarises the history so far and starts over
            body = self._claude_body(t)
        return convert_messages(msgspec.convert(body, CountTokensRequest))

    def _claude_body(self, t: int) -> dict[str, Any]:
        reminder = (
            f"<system-reminder>Todo list: {t} item(s) done; the file src/cache.py changed "
            f"since it was read (request {t}).</system-reminder>"
        )
        first = TASK
        if self._compacted:
            done = " ".join(s.reasoning for s in self.script[: self._compacted])
            first = f"This session continues a previous one. Summary: {done[:2000]}\n\n{TASK}"
        content: list[dict[str, Any]] = [{"type": "text", "text": first}]
        msgs: list[dict[str, Any]] = [{"role": "user", "content": content}]
        for i in range(self._compacted, t):
            s = self.script[i]
            blocks: list[dict[str, Any]] = []
            if i == t - 1:  # thinking kept on the last assistant message only
                blocks.append({"type": "thinking", "thinking": s.reasoning, "signature": "sig"})
            if s.text:
                blocks.append({"type": "text", "text": s.text})
            blocks.append({"type": "tool_use", "id": f"toolu_{i}", "name": s.tool, "input": s.args})
            msgs.append({"role": "assistant", "content": blocks})
            result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": s.output}
            msgs.append({"role": "user", "content": [result]})
        msgs[-1]["content"] = [*msgs[-1]["content"], {"type": "text", "text": reminder}]
        system = [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{t};"},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
        ]
        return {
            "model": "m",
            "max_tokens": 1,
            "system": system,
            "messages": msgs,
            "tools": TOOLS_ANTHROPIC,
        }

    # ---- OpenAI Responses: Codex -------------------------------------------------------------
    def _codex(self, t: int) -> list[dict[str, Any]]:
        from freetokend.server.routes.responses import to_chat_request
        from freetokend.server.schemas.responses import ResponsesRequest

        def said(role: str, text: str) -> dict[str, Any]:
            return {
                "type": "message",
                "role": role,
                "content": [{"type": "input_text", "text": text}],
            }

        items = [
            said("developer", SYSTEM),
            said("user", "<environment_context>cwd /repo</environment_context>"),
            said("user", TASK),
        ]
        middle = len(self.script) // 2
        for i, s in enumerate(self.script[:t]):
            summary = [{"type": "summary_text", "text": s.reasoning}]
            items.append({"type": "reasoning", "id": f"rs_{i}", "summary": summary})
            call = {"type": "function_call", "id": f"fc_{i}", "call_id": f"call_{i}"}
            items.append(
                {**call, "name": s.tool, "arguments": json.dumps(s.args), "status": "completed"}
            )
            items.append(
                {"type": "function_call_output", "call_id": f"call_{i}", "output": s.output}
            )
            if i == middle - 1:
                items.append(said("user", "Also run the whole test module before you finish."))
        body = {"model": "m", "input": items, "tools": OPENAI_RESPONSES_TOOLS, "store": False}
        return to_chat_request(msgspec.convert(body, ResponsesRequest)).messages


TOOLS_ANTHROPIC = [
    {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
    for t in TOOLS
]
OPENAI_RESPONSES_TOOLS = [{"type": "function", "strict": False, **t} for t in TOOLS]


# Qwen3's chat template, written from its documented behaviour: tools in the system turn, the
# reasoning of assistant turns kept only after the last user query (a user message that is not a
# tool response), tool responses of consecutive tool messages in one user turn.
QWEN3_TEMPLATE = """\
{%- macro text_of(c) -%}
{%- if c is string -%}{{- c -}}{%- elif c -%}{%- for p in c -%}{%- if p.type == 'text' -%}{{- p.text -}}{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if has_system -%}{{- text_of(messages[0].content) + '\\n\\n' -}}{%- endif -%}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' -}}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' -}}
{{- '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif has_system -%}
{{- '<|im_start|>system\\n' + text_of(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' and not (text_of(m.content).startswith('<tool_response>')) -%}
{%- set ns.last_query = loop.index0 -%}
{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if loop.first and has_system -%}{%- continue -%}{%- endif -%}
{%- if m.role == 'user' or m.role == 'system' -%}
{{- '<|im_start|>' + m.role + '\\n' + text_of(m.content) + '<|im_end|>\\n' -}}
{%- elif m.role == 'assistant' -%}
{%- set content = text_of(m.content) -%}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}
{%- else -%}
{{- '<|im_start|>assistant\\n' + content -}}
{%- endif -%}
{%- for call in m.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + text_of(m.content) + '\\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""
