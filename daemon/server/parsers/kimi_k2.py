"""Kimi-K2 / K2.5 tool calls: a section of calls, each named by its id ``functions.NAME:IDX``
and carrying its arguments as one JSON object::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>functions.read:1<|tool_call_argument_begin|>{"path": "a.py"}<|tool_call_end|><|tool_calls_section_end|>

(each marker one special token). Kimi's templates write no whitespace around the markers and
put the section right after the message's text. The id is the model's own: K2-Thinking's
template numbers the calls across the whole conversation, K2-Instruct's within the message, and
K2-Instruct writes the id back into each tool result (``## Return of functions.read:1``), so a
call keeps the id the model wrote (``ToolCall.id``; one that repeats an earlier id of the same
output, or that is not of that form, is left to the API layer to name).

Thinking is ``<think>...</think>`` (think.py, in front of this parser); a model that opens the
section before closing its reasoning ends the reasoning there (``OPENS``, registry.py).

As llama.cpp reads Kimi's output, a model's slips are tolerated: a call without its section
(``<|tool_call_begin|>`` in the text), a call without its ``<|tool_call_end|>`` (the next call,
the section's end or the end of the output ends it), whitespace between calls; and a call's end
or the section's opening written twice. Inside the
arguments a marker counts only outside JSON strings: a string may hold ``<|tool_call_end|>``.
What does not decode is given back as text, markers included.

Cut by the token limit, the call being written is a partial call: its arguments as far as they
were written, its name the one tool the cut name begins (or the only tool when the cut falls
before the name, in the opener included).
"""

from __future__ import annotations

import json
import re

from .base import (
    Content,
    OutputParser,
    ParsedEvent,
    ToolCall,
    ToolSchemas,
    loads_bounded,
    partial_suffix,
    unique_tool,
)
from .tagged import JSON_STRINGS, CloseFinder

SECTION_OPEN = "<|tool_calls_section_begin|>"
SECTION_CLOSE = "<|tool_calls_section_end|>"
CALL_OPEN = "<|tool_call_begin|>"
ARGS_OPEN = "<|tool_call_argument_begin|>"
CALL_CLOSE = "<|tool_call_end|>"
TAGS = (SECTION_OPEN, SECTION_CLOSE, CALL_OPEN, ARGS_OPEN, CALL_CLOSE)
# what opens tool calls in the text (the section, or a call written without one)
OPENS = (SECTION_OPEN, CALL_OPEN)
ID_PREFIX = "functions."

_MAX_HEAD = 512  # an id still without its argument marker after this many characters is not one
_ID = re.compile(r"functions\.([^\s:<>]+):(\d+)")
_LOOSE_ID = re.compile(r"(?:functions\.)?([^\s:<>]+)(?::\d*)?")
_INSIDE = (CALL_OPEN, SECTION_CLOSE)  # what a section may go on with, past whitespace
_REPEATED = (CALL_CLOSE, SECTION_OPEN)  # a marker written twice by a slip: nothing to read

# where the parser is
_OUT, _SECTION, _HEAD, _ARGS = "out", "section", "head", "args"


def call_name(head: str) -> tuple[str, str] | None:
    """(name, id) of a call's head: ``functions.NAME:IDX`` gives both; a bare ``NAME`` (with or
    without the prefix or the index) the name and no id; None for anything else."""
    head = head.strip()
    m = _ID.fullmatch(head)
    if m is not None:
        return m.group(1), head
    m = _LOOSE_ID.fullmatch(head)
    return (m.group(1), "") if m is not None else None


class KimiToolParser:
    def __init__(self, tools: ToolSchemas) -> None:
        self._tools = tools
        self._buf = ""
        self._state = _OUT
        self._head = ""  # the call being read: what came between its two markers
        self._finder = CloseFinder((CALL_CLOSE, CALL_OPEN, SECTION_CLOSE), JSON_STRINGS)
        self._count = 0  # calls emitted
        self._section_calls = 0  # calls emitted since the section opened
        self._section_open = ""  # the open section's marker (given back when nothing decodes)
        self._ids: set[str] = set()

    def feed(self, text: str) -> list[ParsedEvent]:
        self._buf += text
        out: list[ParsedEvent] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[ParsedEvent]) -> bool:
        """One move through the buffer; False when it needs more text."""
        if self._state == _OUT:
            found = [(p, o) for o in OPENS if (p := self._buf.find(o)) >= 0]
            if not found:
                keep = len(self._buf) - partial_suffix(self._buf, OPENS)
                self._content(self._buf[:keep], out)
                self._buf = self._buf[keep:]
                return False
            pos, opener = min(found)
            self._content(self._buf[:pos], out)
            self._section_calls = 0
            if opener == SECTION_OPEN:
                self._buf, self._state = self._buf[pos + len(opener) :], _SECTION
                self._section_open = opener
            else:  # a call without its section: the call opens it
                self._buf, self._state, self._section_open = self._buf[pos:], _SECTION, ""
            return True
        if self._state == _SECTION:
            rest = self._buf.lstrip()
            if rest.startswith(CALL_OPEN):
                self._buf, self._state = rest[len(CALL_OPEN) :], _HEAD
                return True
            if rest.startswith(SECTION_CLOSE):
                self._buf, self._state = rest[len(SECTION_CLOSE) :], _OUT
                return True
            repeated = next((m for m in _REPEATED if rest.startswith(m)), None)
            if repeated is not None:
                self._buf = rest[len(repeated) :]
                return True
            if not rest or any(m.startswith(rest) for m in (*_INSIDE, *_REPEATED)):
                return False  # whitespace, or a marker not all here yet
            # text in the section: the model went on writing (the section ends there)
            self._give_back_section(out)
            self._buf, self._state = rest, _OUT
            return True
        if self._state == _HEAD:
            pos = self._buf.find(ARGS_OPEN)
            other = min((p for t in _INSIDE if (p := self._buf.find(t)) >= 0), default=-1)
            if pos >= 0 and not 0 <= other < pos:
                self._head = self._buf[:pos]
                self._buf, self._state = self._buf[pos + len(ARGS_OPEN) :], _ARGS
                self._finder.reset()
                return True
            if other < 0 and len(self._buf) <= _MAX_HEAD:
                return False
            # no call after all: its marker and head are text
            end = other if other >= 0 else len(self._buf)
            self._give_back_section(out)
            out.append(Content(CALL_OPEN + self._buf[:end]))
            self._buf, self._state = self._buf[end:], _SECTION if other >= 0 else _OUT
            return True
        hit = self._finder.find(self._buf)
        if hit is None:
            return False
        pos, tag = hit
        body = self._buf[:pos]
        # the closing marker is the call's; the next call or the section's end stays
        self._buf = self._buf[pos + len(tag) :] if tag == CALL_CLOSE else self._buf[pos:]
        self._finder.reset()
        self._state = _SECTION
        self._close_call(body, CALL_CLOSE if tag == CALL_CLOSE else "", out)
        return True

    def _content(self, text: str, out: list[ParsedEvent]) -> None:
        if text:
            out.append(Content(text))

    def _give_back_section(self, out: list[ParsedEvent]) -> None:
        """A section with no call decoded gives its opening marker back as text."""
        if not self._section_calls and self._section_open:
            out.append(Content(self._section_open))
        self._section_open = ""

    def _close_call(self, body: str, close: str, out: list[ParsedEvent]) -> None:
        named = call_name(self._head)
        try:
            args = loads_bounded(body) if named else None
        except ValueError:
            args = None
        if named is None or not isinstance(args, dict):
            self._give_back_section(out)
            out.append(Content(CALL_OPEN + self._head + ARGS_OPEN + body + close))
            return
        name, call_id = named
        self._emit(name, json.dumps(args, ensure_ascii=False), call_id, False, out)

    def _emit(self, name: str, arguments: str, call_id: str, partial: bool, out: list) -> None:
        if call_id in self._ids:
            call_id = ""  # the same id twice in one output: the API layer names this one
        self._ids.add(call_id)
        out.append(ToolCall(self._count, name, arguments, partial=partial, id=call_id))
        self._count += 1
        self._section_calls += 1

    # -- the end ----------------------------------------------------------------------------

    def finish(self, truncated: bool = False) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        while self._state == _ARGS and not truncated and self._finder.quote_open:
            # a quote the model never closed swallowed the closing marker (malformed output):
            # the call ends at the first marker after all, as it would with no quoting
            found = [(p, t) for t in (CALL_CLOSE, *_INSIDE) if (p := self._buf.find(t)) >= 0]
            if not found:
                break
            pos, tag = min(found)
            body = self._buf[:pos]
            rest = self._buf[pos + len(tag) :] if tag == CALL_CLOSE else self._buf[pos:]
            self._state, self._buf = _SECTION, ""
            self._finder.reset()
            self._close_call(body, tag if tag == CALL_CLOSE else "", out)
            out.extend(self.feed(rest))
        if truncated:
            self._finish_cut(out)
        elif self._state == _ARGS:  # stopped (a stop string, or no closing marker at all)
            self._close_call(self._buf, "", out)
        elif self._state == _HEAD:
            self._give_back_section(out)
            out.append(Content(CALL_OPEN + self._buf))
        elif self._state == _SECTION:
            self._give_back_section(out)
            if self._buf.strip():
                out.append(Content(self._buf))
        else:
            self._content(self._buf, out)
        self._buf, self._state = "", _OUT
        self._finder.reset()
        return out

    def _finish_cut(self, out: list[ParsedEvent]) -> None:
        """The token limit ended the output: the call being written is a partial call; markup
        cut short is dropped."""
        only = next(iter(self._tools)) if len(self._tools) == 1 else None
        if self._state == _OUT:
            if self._buf and only is not None:  # cut inside the opener (held back: all of it)
                self._emit(only, "{}", "", True, out)
        elif self._state == _SECTION:
            if not self._section_calls and only is not None:
                self._emit(only, "{}", "", True, out)
        elif self._state == _HEAD:
            head = self._buf[: len(self._buf) - partial_suffix(self._buf, (ARGS_OPEN,))].strip()
            named = call_name(head)
            if named is not None and named[0] in self._tools and _ID.fullmatch(head):
                self._emit(named[0], "{}", named[1], True, out)
                return
            prefix = "" if ID_PREFIX.startswith(head) else head.removeprefix(ID_PREFIX)
            prefix, colon, _ = prefix.partition(":")
            if colon and prefix in self._tools:  # the name whole, its index cut
                name: str | None = prefix
            else:
                name = unique_tool(prefix, self._tools) if prefix else only
            if name is not None:
                self._emit(name, "{}", "", True, out)
        elif self._state == _ARGS:
            body = self._buf.lstrip()
            if not self._finder.quote_open:  # a marker cut at the very end is no argument
                body = body[: len(body) - partial_suffix(body, (CALL_CLOSE, *_INSIDE))].rstrip()
            named = call_name(self._head)
            if named is not None:
                self._emit(named[0], body or "{}", named[1], True, out)


def make_parser(tools: ToolSchemas) -> OutputParser:
    return KimiToolParser(tools)
