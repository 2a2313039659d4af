"""Framing shared by the tagged tool-call syntaxes: a call is ``<tool_call>BODY</tool_call>``
(Qwen, GLM), or a block of several calls between other tags (MiniMax-M2's
``<minimax:tool_call>``).

Content outside the tags streams; the body is buffered until the closing tag and handed to
the syntax's ``decode_body``. A body that does not decode is given back as plain content, so
nothing the model wrote is lost.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Content, ParsedEvent, ToolCall, partial_suffix

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

# body text -> (name, arguments as a JSON object text), or None when it is not a call; a
# block syntax returns a list of them (one per call in the block, at least one)
BodyDecoder = Callable[[str], tuple[str, str] | list[tuple[str, str]] | None]


class TaggedToolParser:
    def __init__(
        self,
        decode_body: BodyDecoder,
        open_tag: str = OPEN,
        close_tag: str = CLOSE,
        *,
        decode_partial: BodyDecoder | None = None,
    ) -> None:
        """``decode_partial``: (name, arguments so far) of a body cut by the token limit, or
        None when not even the tool's name can be told."""
        self._decode = decode_body
        self._decode_partial = decode_partial
        self._open, self._close = open_tag, close_tag
        self._buf = ""
        self._in_call = False
        self._count = 0

    def feed(self, text: str) -> list[ParsedEvent]:
        self._buf += text
        out: list[ParsedEvent] = []
        while True:
            marker = self._close if self._in_call else self._open
            pos = self._buf.find(marker)
            if pos < 0:
                break
            if self._in_call:
                self._close_call(self._buf[:pos], out)
            elif pos:
                out.append(Content(self._buf[:pos]))
            self._buf = self._buf[pos + len(marker) :]
            self._in_call = not self._in_call
        if not self._in_call:
            hold = partial_suffix(self._buf, (self._open,))
            if len(self._buf) > hold:
                out.append(Content(self._buf[: len(self._buf) - hold]))
                self._buf = self._buf[len(self._buf) - hold :]
        return out

    def finish(self, truncated: bool = False) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        if truncated and not self._in_call and self._buf and self._open.startswith(self._buf):
            self._in_call, self._buf = True, ""  # cut inside the opening tag itself
        if self._in_call and truncated and self._decode_partial is not None:
            # The token limit cut a call: it is still a call (partial arguments), as OpenAI
            # and vLLM answer; cut before the tool's name, there is nothing to report.
            decoded = self._decode_partial(self._buf)
            calls = decoded if isinstance(decoded, list) else [decoded] if decoded else []
            for i, (name, arguments) in enumerate(calls):  # only the last one was cut
                out.append(ToolCall(self._count, name, arguments, partial=i == len(calls) - 1))
                self._count += 1
        elif self._in_call:
            # Generation stopped inside a call (a stop string): keep it if the body is
            # already complete, else give the text back.
            self._close_call(self._buf, out)
        elif self._buf:
            out.append(Content(self._buf))
        self._buf = ""
        self._in_call = False
        return out

    def _close_call(self, body: str, out: list[ParsedEvent]) -> None:
        decoded = self._decode(body)
        if not decoded:
            out.append(Content(self._open + body + self._close))
            return
        for name, arguments in decoded if isinstance(decoded, list) else [decoded]:
            out.append(ToolCall(self._count, name, arguments))
            self._count += 1
