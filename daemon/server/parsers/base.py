"""What an output parser turns generated text into, and the streaming helpers they share.

A parser is fed the detokenized text piece by piece (``feed``) and flushed once at the end
(``finish``). It returns events in order: plain content, reasoning, and complete tool calls.
A tool call is emitted whole when its closing marker arrives (the API layers then stream it
as one delta); text around it streams as it is generated. Text that might be the start of a
marker (``"<tool_"``) is held back until the next piece decides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InvalidRequest
from ..limits import json_shape


def loads_bounded(text: str) -> Any:
    """``json.loads`` (control characters allowed) for model output: ValueError for text that
    is not JSON or nests deeper than the request limits (which would overflow the stack when
    the value is dumped or rendered again)."""
    try:
        value = json.loads(text, strict=False)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    try:
        json_shape(value, "arguments")
    except InvalidRequest as e:
        raise ValueError(e.message) from None
    return value


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A complete call: ``arguments`` is a JSON object text."""

    index: int
    name: str
    arguments: str


ParsedEvent = Content | Reasoning | ToolCall

# name -> JSON schema of its parameters (parsers that need types, e.g. XML values)
ToolSchemas = dict[str, dict[str, Any]]


class OutputParser(Protocol):
    def feed(self, text: str) -> list[ParsedEvent]: ...

    def finish(self) -> list[ParsedEvent]: ...


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

    def finish(self) -> list[ParsedEvent]:
        return []
