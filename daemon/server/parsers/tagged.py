"""Framing shared by the tagged tool-call syntaxes: a call is ``<tool_call>BODY</tool_call>``
(Qwen, GLM), or a block of several calls between other tags (MiniMax-M2's
``<minimax:tool_call>``).

Content outside the tags streams; the body is buffered until the closing tag and handed to
the syntax's ``decode_body``. A body that does not decode is given back as plain content, so
nothing the model wrote is lost.

Inside a call, the closing tag counts only outside the syntax's quoted stretches (JSON strings,
XML parameter values, Gemma's quoted strings): an argument may hold the text ``</tool_call>``
(a coding agent writing this very parser) and the call goes on. Output that opens a quoted
stretch and never closes it is read at the end as if nothing were quoted, so nothing is lost.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from .base import Content, ParsedEvent, ToolCall, partial_suffix

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

# body text -> (name, arguments as a JSON object text), or None when it is not a call; a
# block syntax returns a list of them (one per call in the block, at least one)
BodyDecoder = Callable[[str], tuple[str, str] | list[tuple[str, str]] | None]


@dataclass(frozen=True)
class Quoted:
    """A stretch of a call body in which tags are text: from ``open`` to ``close``; ``escape``
    takes the character after it literally (JSON's backslash)."""

    open: str
    close: str
    escape: str = ""


JSON_STRINGS = (Quoted('"', '"', "\\"),)


class CloseFinder:
    """Finds the first of ``closes`` outside the quoted stretches of a text that grows between
    calls (a call body as it streams), scanning each character once."""

    def __init__(self, closes: tuple[str, ...], quoted: tuple[Quoted, ...] = ()) -> None:
        self._closes, self._quoted = closes, quoted
        self._opens = tuple(q.open for q in quoted)
        self._outside = _first_chars(*closes, *self._opens)
        self._inside_jump = {q: _first_chars(q.close, q.escape) for q in quoted}
        self.reset()

    def reset(self) -> None:
        self._pos = 0
        self._inside: Quoted | None = None

    @property
    def quote_open(self) -> bool:
        """The text so far ends inside a quoted stretch."""
        return self._inside is not None

    def find(self, text: str) -> tuple[int, str] | None:
        """(position, tag) of the first closing tag outside quotes in ``text``, or None for not
        yet (``text`` must extend the text of the previous call until ``reset``)."""
        i, n = self._pos, len(text)
        while True:
            q = self._inside
            m = (self._outside if q is None else self._inside_jump[q]).search(text, i)
            if m is None:
                self._pos = n
                return None
            i = m.start()
            if q is None:
                close = next((c for c in self._closes if text.startswith(c, i)), None)
                if close is not None:
                    self._pos = i
                    return i, close
                opened = next((o for o in self._quoted if text.startswith(o.open, i)), None)
                if opened is not None:
                    self._inside, i = opened, i + len(opened.open)
                    continue
                if _cut_marker(text, i, (*self._closes, *self._opens)):
                    self._pos = i
                    return None
            elif q.escape and text[i] == q.escape:
                if i + 1 >= n:
                    self._pos = i
                    return None
                i += 2
                continue
            elif text.startswith(q.close, i):
                self._inside, i = None, i + len(q.close)
                continue
            elif _cut_marker(text, i, (q.close,)):
                self._pos = i
                return None
            i += 1


def _first_chars(*markers: str) -> re.Pattern[str]:
    chars = sorted({m[0] for m in markers if m})
    return re.compile("[" + "".join(re.escape(c) for c in chars) + "]")


def _cut_marker(text: str, i: int, markers: tuple[str, ...]) -> bool:
    """``text[i:]`` is a proper prefix of a marker (the next piece may complete it)."""
    tail = text[i:]
    return any(len(tail) < len(m) and m.startswith(tail) for m in markers)


class TaggedToolParser:
    def __init__(
        self,
        decode_body: BodyDecoder,
        open_tag: str = OPEN,
        close_tag: str = CLOSE,
        *,
        decode_partial: BodyDecoder | None = None,
        quoted: tuple[Quoted, ...] = (),
        separators: tuple[str, str] = ("", ""),
    ) -> None:
        """``decode_partial``: (name, arguments so far) of a body cut by the token limit, or
        None when not even the tool's name can be told. ``quoted``: the body's stretches in
        which the closing tag is text. ``separators``: what the chat template writes between
        the content and the first call, and between two calls; the generated text's separator
        there is not content (so the content a client sends back renders to the same text)."""
        self._decode = decode_body
        self._decode_partial = decode_partial
        self._open, self._close = open_tag, close_tag
        self._seps = separators
        # held back at the end of the text: what may be (a separator and) an opening tag
        self._hold = (open_tag, *(sep + open_tag for sep in separators if sep))
        self._finder = CloseFinder((close_tag,), quoted)
        self._buf = ""
        self._in_call = False
        self._count = 0

    def feed(self, text: str) -> list[ParsedEvent]:
        self._buf += text
        out: list[ParsedEvent] = []
        while True:
            if self._in_call:
                hit = self._finder.find(self._buf)
                if hit is None:
                    break
                pos = hit[0]
                self._close_call(self._buf[:pos], out)
                self._buf = self._buf[pos + len(self._close) :]
                self._finder.reset()
                self._in_call = False
                continue
            pos = self._buf.find(self._open)
            if pos < 0:
                break
            before = self._buf[:pos]
            sep = self._seps[0 if self._count == 0 else 1]
            if sep and before.endswith(sep):
                before = before[: -len(sep)]
            if before:
                out.append(Content(before))
            self._buf = self._buf[pos + len(self._open) :]
            self._in_call = True
        if not self._in_call:
            hold = partial_suffix(self._buf, self._hold)
            if len(self._buf) > hold:
                out.append(Content(self._buf[: len(self._buf) - hold]))
                self._buf = self._buf[len(self._buf) - hold :]
        return out

    def finish(self, truncated: bool = False) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        if truncated and not self._in_call and self._buf:
            sep = self._seps[0 if self._count == 0 else 1]
            tag = self._buf[len(sep) :] if sep and self._buf.startswith(sep) else self._buf
            if tag and self._open.startswith(tag):
                self._in_call, self._buf = True, ""  # cut inside the opening tag itself
        while (
            self._in_call
            and not truncated
            and self._finder.quote_open
            and (pos := self._buf.find(self._close)) >= 0
        ):
            # a closing tag inside a quoted stretch the model never ended (malformed output):
            # the call ends there after all, as it would with no quoting
            rest = self._buf[pos + len(self._close) :]
            self._close_call(self._buf[:pos], out)
            self._buf, self._in_call = "", False
            self._finder.reset()
            out.extend(self.feed(rest))
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
        self._finder.reset()
        return out

    def _close_call(self, body: str, out: list[ParsedEvent]) -> None:
        decoded = self._decode(body)
        if not decoded:
            out.append(Content(self._open + body + self._close))
            return
        for name, arguments in decoded if isinstance(decoded, list) else [decoded]:
            out.append(ToolCall(self._count, name, arguments))
            self._count += 1
