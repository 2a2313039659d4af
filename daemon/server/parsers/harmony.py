"""GPT-OSS "harmony" output: a stream of messages, each ``HEADER<|message|>BODY<end>``.

The header names a channel (``<|channel|>analysis`` = reasoning, ``final`` = the answer,
``commentary`` = preambles or tool calls) and maybe a recipient (``to=functions.NAME``, before
or after the channel). Bodies end with ``<|end|>``, ``<|call|>`` or ``<|return|>``; the next
message starts with ``<|start|>assistant``. The last end marker is usually the EOS token and
so never reaches the text: ``finish`` flushes whatever message is open. A call's body is JSON:
an end marker inside one of its strings is text.
"""

from __future__ import annotations

import json
import re

from .base import (
    Content,
    ParsedEvent,
    Reasoning,
    ToolCall,
    ToolSchemas,
    loads_bounded,
    merge,
    partial_suffix,
    unique_tool,
)
from .tagged import JSON_STRINGS, CloseFinder

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
START = "<|start|>"
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CALL_HEADER = "<|channel|>commentary to=functions."  # how a call's header begins


class HarmonyParser:
    def __init__(self, tools: ToolSchemas | None = None) -> None:
        self._tools = tools or {}
        self._buf = ""
        self._in_body = False
        self._channel = ""
        self._recipient: str | None = None
        self._call_body = ""
        self._count = 0
        self._call_end = CloseFinder(ENDS, JSON_STRINGS)

    def feed(self, text: str) -> list[ParsedEvent]:
        self._buf += text
        out: list[ParsedEvent] = []
        while self._step(out):
            pass
        return merge(out)

    def finish(self, truncated: bool = False) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        ends = [(p, m) for m in ENDS if (p := self._buf.find(m)) >= 0]
        if self._in_body and self._call_end.quote_open and not truncated and ends:
            # an end marker inside a string the model never closed (malformed output): the
            # call ends there after all, as it would with no quoting
            pos, marker = min(ends)
            rest = self._buf[pos + len(marker) :]
            self._body_text(self._buf[:pos], out)
            self._buf = ""
            self._end_message(out)
            return merge(out + self.feed(rest) + self.finish())
        if self._in_body:
            self._body_text(self._buf, out)
            self._end_message(out, truncated)
        elif truncated and (name := self._cut_call_header(self._buf)) is not None:
            # the token limit cut a call's header: a call to the tool it names
            out.append(ToolCall(self._count, name, "{}", True))
            self._count += 1
        elif self._buf.strip():
            # a header that never opened a body: keep the text rather than drop it
            out.append(Content(self._strip_header_noise(self._buf)))
        self._buf = ""
        return merge(out)

    def _step(self, out: list[ParsedEvent]) -> bool:
        """Consume one marker from the buffer; False when more text is needed."""
        if not self._in_body:
            pos = self._buf.find(MESSAGE)
            if pos < 0:
                return False
            self._open_message(self._buf[:pos])
            self._buf = self._buf[pos + len(MESSAGE) :]
            return True
        if self._recipient is not None:  # a call: its JSON is kept whole until it ends
            hit = self._call_end.find(self._buf)
            if hit is None:
                return False
            pos, marker = hit
        else:
            hits = [(self._buf.find(m), m) for m in ENDS]
            hits = [(p, m) for p, m in hits if p >= 0]
            if not hits:
                hold = partial_suffix(self._buf, ENDS)
                self._body_text(self._buf[: len(self._buf) - hold], out)
                self._buf = self._buf[len(self._buf) - hold :]
                return False
            pos, marker = min(hits)
        self._body_text(self._buf[:pos], out)
        self._buf = self._buf[pos + len(marker) :]
        self._end_message(out)
        return True

    def _open_message(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else "final"
        self._recipient = recipient.group(1) if recipient else None
        self._in_body = True
        self._call_body = ""
        self._call_end.reset()

    def _body_text(self, text: str, out: list[ParsedEvent]) -> None:
        if not text:
            return
        if self._recipient is not None:
            self._call_body += text
        elif self._channel == "analysis":
            out.append(Reasoning(text))
        else:
            out.append(Content(text))

    def _end_message(self, out: list[ParsedEvent], truncated: bool = False) -> None:
        if self._recipient is not None and truncated:
            # cut by the token limit: still a call, with its arguments so far
            name = self._recipient.removeprefix("functions.")
            out.append(ToolCall(self._count, name, self._call_body.strip() or "{}", True))
            self._count += 1
        elif self._recipient is not None:
            name = self._recipient.removeprefix("functions.")
            try:
                args = loads_bounded(self._call_body or "{}")
            except ValueError:
                args = None
            if isinstance(args, dict):
                out.append(ToolCall(self._count, name, json.dumps(args, ensure_ascii=False)))
                self._count += 1
            else:
                out.append(Content(self._call_body))
        self._in_body = False
        self._recipient = None
        self._channel = ""

    def _cut_call_header(self, header: str) -> str | None:
        """The tool a header cut by the token limit calls: the one it names, or, cut before
        the name, the only tool when the header so far can only be a call's."""
        cut = _RECIPIENT.search(header)
        if cut is not None:
            return unique_tool(cut.group(1).removeprefix("functions."), self._tools)
        text = self._strip_header_noise(header).strip()
        if len(self._tools) == 1 and text and _CALL_HEADER.startswith(text):
            return next(iter(self._tools))
        return None

    @staticmethod
    def _strip_header_noise(text: str) -> str:
        return text.replace(START + "assistant", "").replace(START, "")


def make_parser(tools: ToolSchemas) -> HarmonyParser:
    return HarmonyParser(tools)
