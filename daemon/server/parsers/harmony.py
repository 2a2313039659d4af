"""GPT-OSS "harmony" output: a stream of messages, each ``HEADER<|message|>BODY<end>``.

The header names a channel (``<|channel|>analysis`` = reasoning, ``final`` = the answer,
``commentary`` = preambles or tool calls) and maybe a recipient (``to=functions.NAME``, before
or after the channel). Bodies end with ``<|end|>``, ``<|call|>`` or ``<|return|>``; the next
message starts with ``<|start|>assistant``. The last end marker is usually the EOS token and
so never reaches the text: ``finish`` flushes whatever message is open.
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

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
START = "<|start|>"
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyParser:
    def __init__(self, tools: ToolSchemas | None = None) -> None:
        self._tools = tools or {}
        self._buf = ""
        self._in_body = False
        self._channel = ""
        self._recipient: str | None = None
        self._call_body = ""
        self._count = 0

    def feed(self, text: str) -> list[ParsedEvent]:
        self._buf += text
        out: list[ParsedEvent] = []
        while self._step(out):
            pass
        return merge(out)

    def finish(self, truncated: bool = False) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        if self._in_body:
            self._body_text(self._buf, out)
            self._end_message(out, truncated)
        elif truncated and (cut := _RECIPIENT.search(self._buf)) is not None:
            # the token limit cut a call's header: a call to the tool it names (if one does)
            name = unique_tool(cut.group(1).removeprefix("functions."), self._tools)
            if name is not None:
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

    @staticmethod
    def _strip_header_noise(text: str) -> str:
        return text.replace(START + "assistant", "").replace(START, "")


def make_parser(tools: ToolSchemas) -> HarmonyParser:
    return HarmonyParser(tools)
