"""DeepSeek-V4 and DeepSeek-V3.2 tool calls in "DSML": a block of invocations whose tags carry
the ``｜DSML｜`` marker (one special token; U+FF5C fullwidth bars)::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    <｜DSML｜invoke name="write_file">
    ...
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

V4 names the block ``tool_calls``, V3.2 ``function_calls``; the parser reads both. The templates
put ``\\n\\n`` between the message's text and the block: whitespace right before a block is
markup, not content. ``string="true"``: the value is the raw text up to the parameter's closing
tag, kept verbatim (multi-line code included; no padding is stripped, the template writes none).
``string="false"``: the value is JSON (numbers, booleans, null, arrays, objects); a closing tag
inside one of its JSON strings belongs to the string. Thinking is ``<think>...</think>``
(think.py), in front of this parser.

Calls stream one by one: each is emitted when its ``</｜DSML｜invoke>`` arrives, without
waiting for the block to close. A block whose structure breaks (stray text between tags, an
unknown tag) is read loosely up to its closing tag, each value ending at the first closing tag,
as a model's slip deserves; what still does not decode is given back as text.

Cut by the token limit, the call being written is a partial call, wherever the cut falls: in
the whitespace before the block (when that is all the output and there is one tool: a forced
call starts so), in a tag, or inside a ``｜`` whose bytes the limit split (the detokenizer
flushes them as U+FFFD after the tag's start).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import (
    Content,
    OutputParser,
    ParsedEvent,
    ToolCall,
    ToolSchemas,
    arguments_object,
    loads_bounded,
    merge,
    partial_suffix,
    unique_tool,
)
from .qwen3_xml import convert_value, schema_types

DSML = "｜DSML｜"
BLOCK_V4 = "tool_calls"
BLOCK_V3_2 = "function_calls"
OPENS = (f"<{DSML}{BLOCK_V4}>", f"<{DSML}{BLOCK_V3_2}>")
PARAM_CLOSE = f"</{DSML}parameter>"

# one DSML tag: closing slash, element name, attributes (whitespace after the marker tolerated)
_TAG = re.compile(rf'<(/?){DSML}\s*([A-Za-z_]+)((?:\s+[A-Za-z_]+="[^"]*")*)\s*>')
_ATTR = re.compile(r'([A-Za-z_]+)="([^"]*)"')
_TAG_STARTS = (f"<{DSML}", f"</{DSML}")
_MAX_TAG = 512  # a tag still open after this many characters is not one
_WS = re.compile(r"\s*")
_IN_STRING = re.compile(r'["\\]')  # what ends or escapes inside a JSON string
_OUT_STRING = re.compile(r'["<]')  # a string opening, or maybe the closing tag

# the loose reading of a broken block (first closing tag wins)
_LOOSE_INVOKE = re.compile(
    rf'<{DSML}\s*invoke\s+name="([^"]*)"\s*>(.*?)(</{DSML}\s*invoke>|$)', re.S
)
_LOOSE_PARAM = re.compile(
    rf'<{DSML}\s*parameter\s+name="([^"]*)"(?:\s+string="([^"]*)")?\s*>(.*?)(?:</{DSML}\s*parameter>|$)',
    re.S,
)
_CUT_INVOKE = re.compile(rf'<{DSML}\s*invoke\s+name="([^"]*)$')

# where the scanner is inside a block
_BLOCK, _INVOKE, _VALUE, _BROKEN = "block", "invoke", "value", "broken"
_WAIT, _BAD = "wait", "bad"  # no tag at the scan position (yet)


def convert(raw: str, string_attr: str | None, types: set[str]) -> Any:
    """A parameter's text as its JSON value: the ``string`` attribute decides, the schema
    corrects a model that mislabelled one (a raw "3" for an integer, a JSON 12345 for a
    string); without the attribute the schema alone decides, as for the other XML syntaxes."""
    if string_attr == "true":
        if types and "string" not in types:
            return convert_value(raw, types)
        return raw
    if string_attr == "false":
        try:
            value = loads_bounded(raw)
        except ValueError:
            return raw
        if types == {"string"} and not isinstance(value, str):
            return raw.strip()
        return value
    return convert_value(raw, types)


_CUT_CHAR = "\ufffd"  # a character the token limit cut mid-bytes, as the detokenizer flushes it


def _cut_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the suffix of ``text`` that may begin one of ``tags``: a proper prefix of one
    (``partial_suffix``), or a prefix followed by U+FFFD where the tag goes on with a non-ASCII
    character. ``｜`` is three bytes: a limit that cuts a byte-level ``<｜DSML｜`` inside a bar
    leaves ``<`` + U+FFFD at the end of the text."""
    held = partial_suffix(text, tags)
    body = text.rstrip(_CUT_CHAR)
    bad = len(text) - len(body)
    if not 0 < bad <= 3:  # a UTF-8 character has at most three bytes before its last
        return held
    for tag in tags:
        for k in range(min(len(tag) - 1, len(body)), 0, -1):
            if not tag[k].isascii() and body.endswith(tag[:k]):
                held = max(held, k + bad)
                break
    return held


def _skip_ws(text: str, pos: int) -> int:
    m = _WS.match(text, pos)
    assert m is not None  # \s* always matches
    return m.end()


class DsmlToolParser:
    def __init__(self, tools: ToolSchemas) -> None:
        self._tools = tools
        # outside a block: the text held back; inside: the block since the last emitted call
        self._buf = ""
        self._in_block = False
        self._opener = ""  # the open block's opening tag
        self._stage = _BLOCK
        self._pos = 0  # scan position in _buf
        self._count = 0  # calls emitted
        self._block_calls = 0  # calls emitted from the open block
        self._name = ""  # the invocation being read, its arguments so far
        self._args: dict[str, Any] = {}
        self._key = ""  # the parameter being read
        self._string_attr: str | None = None
        self._value_start = 0
        self._scan = 0  # where the value's scan resumes
        self._track: bool | None = None  # JSON value: follow its strings (None: not seen yet)
        self._in_str = False
        self._quiet = True  # nothing emitted yet (all the text so far was whitespace)

    # -- outside a block --------------------------------------------------------------------

    def feed(self, text: str) -> list[ParsedEvent]:
        out = self._feed(text)
        self._quiet = self._quiet and not out
        return out

    def _feed(self, text: str) -> list[ParsedEvent]:
        self._buf += text
        out: list[ParsedEvent] = []
        while True:
            if self._in_block:
                if not self._scan_block(out):
                    break
                continue
            found = [(p, o) for o in OPENS if (p := self._buf.find(o)) >= 0]
            if not found:
                hold = len(self._buf) - _cut_suffix(self._buf, OPENS)
                shown = self._buf[:hold].rstrip()  # whitespace may precede a block: held
                if shown:
                    out.append(Content(shown))
                self._buf = self._buf[len(shown) :]
                break
            pos, opener = min(found)
            shown = self._buf[:pos].rstrip()  # the template's separator before a block
            if shown:
                out.append(Content(shown))
            self._open_block(self._buf[pos + len(opener) :], opener)
        return out

    def _open_block(self, rest: str, opener: str) -> None:
        self._in_block, self._opener = True, opener
        self._buf, self._pos, self._stage, self._block_calls = rest, 0, _BLOCK, 0

    def _close_tag(self) -> str:
        return "</" + self._opener[1:]

    # -- inside a block ---------------------------------------------------------------------

    def _scan_block(self, out: list[ParsedEvent]) -> bool:
        """Reads as far as the buffer allows; True when the block closed (the rest of the
        buffer is outside text again)."""
        while True:
            if self._stage == _BROKEN:
                return self._end_broken(out)
            if self._stage == _VALUE:
                end = self._value_end()
                if end < 0:
                    return False
                raw = self._buf[self._value_start : end]
                types = schema_types(self._tools.get(self._name), self._key)
                self._args[self._key] = convert(raw, self._string_attr, types)
                self._pos, self._stage = end + len(PARAM_CLOSE), _INVOKE
                continue
            self._pos = _skip_ws(self._buf, self._pos)
            tag = self._tag_at(self._pos)
            if tag == _WAIT:
                return False
            if isinstance(tag, str):
                self._stage = _BROKEN
                continue
            closing, element = tag.group(1) == "/", tag.group(2)
            attrs = dict(_ATTR.findall(tag.group(3)))
            if self._stage == _BLOCK and closing and element in (BLOCK_V4, BLOCK_V3_2):
                self._buf, self._in_block = self._buf[tag.end() :], False
                return True
            if self._stage == _BLOCK and not closing and element == "invoke" and "name" in attrs:
                self._name, self._args = attrs["name"].strip(), {}
                self._pos, self._stage = tag.end(), _INVOKE
            elif self._stage == _INVOKE and closing and element == "invoke":
                arguments = json.dumps(self._args, ensure_ascii=False)
                out.append(ToolCall(self._count, self._name, arguments))
                self._count += 1
                self._block_calls += 1
                self._buf, self._pos, self._stage = self._buf[tag.end() :], 0, _BLOCK
            elif self._stage == _INVOKE and not closing and element == "parameter":
                if "name" not in attrs:
                    self._stage = _BROKEN
                    continue
                self._key, self._string_attr = attrs["name"].strip(), attrs.get("string")
                self._pos = self._value_start = self._scan = tag.end()
                self._track = False if self._string_attr != "false" else None
                self._in_str, self._stage = False, _VALUE
            else:
                self._stage = _BROKEN

    def _tag_at(self, pos: int) -> re.Match[str] | str:
        """The DSML tag at ``pos``, or _WAIT (not all of it has arrived), or _BAD (no tag)."""
        rest = self._buf[pos : pos + _MAX_TAG]
        if not rest:
            return _WAIT
        end = rest.find(">")
        if end < 0:
            could_be = any(rest[: len(s)] == s[: len(rest)] for s in _TAG_STARTS) or (
                _cut_suffix(rest, _TAG_STARTS) == len(rest)  # cut inside a bar
            )
            return _WAIT if could_be and len(rest) < _MAX_TAG and "<" not in rest[1:] else _BAD
        return _TAG.fullmatch(self._buf, pos, pos + end + 1) or _BAD

    def _value_end(self) -> int:
        """Where the value's closing tag starts, or -1 while it has not arrived."""
        buf = self._buf
        if self._track is None:  # a JSON value: its strings are followed when it can hold any
            first = _skip_ws(buf, self._value_start)
            if first == len(buf):
                return -1
            self._track = buf[first] in '{["'
        if not self._track:
            end = buf.find(PARAM_CLOSE, self._scan)
            if end < 0:
                self._scan = max(self._scan, len(buf) - len(PARAM_CLOSE) + 1)
            return end
        i = self._scan
        while True:
            if self._in_str:
                m = _IN_STRING.search(buf, i)
                if m is None:
                    self._scan = len(buf)
                    return -1
                if m.group() == "\\":
                    if m.end() >= len(buf):  # the escaped character has not arrived
                        self._scan = m.start()
                        return -1
                    i = m.end() + 1
                    continue
                self._in_str, i = False, m.end()
                continue
            m = _OUT_STRING.search(buf, i)
            if m is None:
                self._scan = len(buf)
                return -1
            if m.group() == '"':
                self._in_str, i = True, m.end()
                continue
            if buf.startswith(PARAM_CLOSE, m.start()):
                return m.start()
            if PARAM_CLOSE.startswith(buf[m.start() :]):  # maybe the closing tag, cut
                self._scan = m.start()
                return -1
            i = m.end()

    def _end_broken(self, out: list[ParsedEvent]) -> bool:
        """A broken block: read loosely once its closing tag arrives."""
        close_tag = self._close_tag()
        close = self._buf.find(close_tag)
        if close < 0:
            return False
        self._loose(self._buf[:close], out, close_tag)
        self._buf, self._in_block = self._buf[close + len(close_tag) :], False
        return True

    def _loose(self, body: str, out: list[ParsedEvent], tail: str = "", cut: bool = False) -> None:
        """The calls in ``body`` read with first-closing-tag-wins, or the text back (with the
        block's tags) when none decodes. ``cut``: the token limit ended the text, and the
        last, unclosed, invocation is a partial call."""
        calls = []
        for inv in _LOOSE_INVOKE.finditer(body):
            closed = bool(inv.group(3))
            if not closed and not cut:
                break
            name = inv.group(1).strip()
            args: dict[str, Any] = {}
            for pm in _LOOSE_PARAM.finditer(inv.group(2)):
                key = pm.group(1).strip()
                types = schema_types(self._tools.get(name), key)
                args[key] = convert(pm.group(3), pm.group(2), types)
            calls.append((name, json.dumps(args, ensure_ascii=False), not closed))
        if not calls:
            whole = ("" if self._block_calls else self._opener) + body + tail
            if whole.strip():
                out.append(Content(whole))
            return
        for name, arguments, partial in calls:
            out.append(ToolCall(self._count, name, arguments, partial=partial))
            self._count += 1

    # -- the end ----------------------------------------------------------------------------

    def finish(self, truncated: bool = False) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        if not self._in_block:
            head = self._buf.lstrip()
            if truncated and head and _cut_suffix(head, OPENS) == len(head):
                self._open_block("", OPENS[0])  # cut inside the block's opening tag
            elif truncated and self._buf and not head and self._quiet and len(self._tools) == 1:
                # cut inside the whitespace the template writes before a block, and nothing
                # else written: the only tool's call (a forced call starts so)
                self._open_block("", OPENS[0])
            elif self._buf:
                out.append(Content(self._buf))
        if self._in_block and truncated:
            self._finish_cut(out)
        elif self._in_block and self._stage != _BLOCK:
            # Stopped inside an invocation (a stop string), or a JSON value that never closed
            # (a quote the model left open swallowed the closing tag): read loosely; an
            # invocation left unclosed is given back as text.
            self._stage = _BROKEN
            if self._end_broken(out):
                return merge(out + self.feed("") + self.finish())
            self._loose(self._buf, out)
        elif self._in_block:  # stopped between invocations: what follows the last call
            rest = ("" if self._block_calls else self._opener) + self._buf
            if rest.strip():
                out.append(Content(rest))
        self._buf, self._in_block, self._stage = "", False, _BLOCK
        return out

    def _finish_cut(self, out: list[ParsedEvent]) -> None:
        """The token limit cut the block: the call being written is a partial call."""
        if self._stage == _BROKEN:
            self._loose(self._buf, out, cut=True)
            return
        if self._stage == _BLOCK:
            cut = _CUT_INVOKE.search(self._buf, self._pos)
            name = unique_tool(cut.group(1), self._tools) if cut else None
            if name is None and not self._block_calls and len(self._tools) == 1:
                name = next(iter(self._tools))  # cut before the first call: the only tool
            if name is not None:
                out.append(ToolCall(self._count, name, "{}", partial=True))
                self._count += 1
            return
        text = json.dumps(self._args, ensure_ascii=False)
        if self._stage == _VALUE:
            raw = self._buf[self._value_start :]
            if not (self._track and self._in_str):  # in a JSON string it is no tag
                raw = raw[: len(raw) - _cut_suffix(raw, (PARAM_CLOSE,))]
            if self._track is False and self._string_attr != "false":
                value = json.dumps(raw, ensure_ascii=False)[:-1]  # the string so far, open
            else:
                value = raw.strip()  # JSON so far
            if value:
                member = json.dumps(self._key, ensure_ascii=False) + ": " + value
                text = text[:-1] + (", " if self._args else "") + member
        arguments = json.dumps(arguments_object(text), ensure_ascii=False)
        out.append(ToolCall(self._count, self._name, arguments, partial=True))
        self._count += 1


def make_parser(tools: ToolSchemas) -> OutputParser:
    return DsmlToolParser(tools)
