"""A reasoning parser in front of a tool-call parser: reasoning passes through, content is
parsed for tool calls."""

from __future__ import annotations

from .base import Content, OutputParser, ParsedEvent, merge


class Chain:
    def __init__(self, reasoning: OutputParser, tools: OutputParser) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def feed(self, text: str) -> list[ParsedEvent]:
        return merge(self._route(self._reasoning.feed(text)))

    def finish(self, truncated: bool = False) -> list[ParsedEvent]:
        events = self._route(self._reasoning.finish(truncated))
        return merge(events + self._tools.finish(truncated))

    def _route(self, events: list[ParsedEvent]) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        for ev in events:
            if isinstance(ev, Content):
                out.extend(self._tools.feed(ev.text))
            else:
                out.append(ev)
        return out
