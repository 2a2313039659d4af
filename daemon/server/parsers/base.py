"""What an output parser turns generated text into, and the streaming helpers they share.

A parser is fed the detokenized text piece by piece (``feed``) and flushed once at the end
(``finish``). It returns events in order: plain content, reasoning, and complete tool calls.
A tool call is emitted whole when its closing marker arrives (the API layers then stream it
as one delta); text around it streams as it is generated. Text that might be the start of a
marker (``"<tool_"``) is held back until the next piece decides.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InvalidRequest
from ..limits import json_shape


def loads_bounded(text: str) -> Any:
    """``json.loads`` (control characters allowed) for model output: ValueError for text that
    is not JSON or nests deeper than the request limits (which would overflow the stack when
    the value is dumped or rendered again). A lone surrogate escape (``"\\ud800"``, which JSON
    grammars accept) becomes U+FFFD: it has no UTF-8 form, so the response could not be
    encoded."""
    try:
        value = json.loads(text, strict=False)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    try:
        json_shape(value, "arguments")
    except InvalidRequest as e:
        raise ValueError(e.message) from None
    if _SURROGATE_ESCAPE.search(text):
        value = _without_surrogates(value)
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_without_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_without_surrogates(k): _without_surrogates(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call: ``arguments`` is a JSON object text, or, when ``partial`` (the generation hit its
    token limit inside the call), the arguments as far as the model wrote them. ``id``: the
    call's id where the syntax has the model write one (Kimi's ``functions.NAME:IDX``, which
    its template writes back into the tool result); "" for the API layer to name the call."""

    index: int
    name: str
    arguments: str
    partial: bool = False
    id: str = ""


ParsedEvent = Content | Reasoning | ToolCall

# name -> JSON schema of its parameters (parsers that need types, e.g. XML values)
ToolSchemas = dict[str, dict[str, Any]]


class OutputParser(Protocol):
    def feed(self, text: str) -> list[ParsedEvent]: ...

    def finish(self, truncated: bool = False) -> list[ParsedEvent]:
        """The rest; ``truncated``: the token limit ended the generation, so a call left
        open is reported as a partial ToolCall, never as markup in the text."""


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker
    (the part to hold back because the next piece may complete the marker)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def merge(events: list[ParsedEvent]) -> list[ParsedEvent]:
    """Join adjacent events of the same text kind and drop empty text (fewer, larger deltas)."""
    out: list[ParsedEvent] = []
    for ev in events:
        if isinstance(ev, Content | Reasoning):
            if not ev.text:
                continue
            if out and type(out[-1]) is type(ev):
                prev = out[-1]
                assert isinstance(prev, Content | Reasoning)
                out[-1] = type(ev)(prev.text + ev.text)
                continue
        out.append(ev)
    return out


class PassThrough:
    """The parser for models with no tool or reasoning syntax: everything is content."""

    def feed(self, text: str) -> list[ParsedEvent]:
        return [Content(text)] if text else []

    def finish(self, truncated: bool = False) -> list[ParsedEvent]:
        return []


def unique_tool(prefix: str, tools: ToolSchemas) -> str | None:
    """The one tool whose name starts with ``prefix`` (a name cut by the token limit)."""
    names = [name for name in tools if name.startswith(prefix)]
    return names[0] if len(names) == 1 else None


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object (Anthropic's ``input``): partial arguments (cut by the
    token limit) are closed as far as they parse: open strings, arrays and objects closed,
    a dangling key or comma dropped; {} when nothing parses."""
    cut = arguments
    for _ in range(64):  # each try drops the last member; bounded for a hostile text
        try:
            value = loads_bounded(cut + _closers(cut))
        except ValueError:
            value = None
        if isinstance(value, dict):
            return value
        pos = max(cut.rfind(","), cut.rfind("{", 0, len(cut) - 1))
        if pos <= 0:
            break
        cut = cut[:pos] if cut[pos] == "," else cut[: pos + 1]
    return {}


def _closers(text: str) -> str:
    """What closes the strings, arrays and objects ``text`` leaves open."""
    stack: list[str] = []
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    return ('"' if in_str else "") + "".join(reversed(stack))
