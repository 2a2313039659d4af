"""Gemma-4 tool calls and reasoning.

A call is ``<|tool_call>call:NAME{ARGS}<tool_call|>``, one per tag pair. ARGS is Gemma's own
object notation: unquoted keys, strings between ``<|"|>`` markers, numbers / true / false /
null bare, nested objects and arrays as in JSON::

    <|tool_call>call:write_config{path:<|"|>conf/app.json<|"|>,content:{port:8080,
    hosts:[<|"|>a<|"|>,<|"|>b<|"|>]}}<tool_call|>

Reasoning is the thought channel: ``<|channel>thought\\n...<channel|>``; Gemma-4's template
writes ``'<|channel>thought\\n' + thinking + '\\n<channel|>'`` and the calls right after it
(``THOUGHT_SEPARATORS``).
"""

from __future__ import annotations

import json
from typing import Any

from ..limits import MAX_JSON_DEPTH
from .base import ToolSchemas, unique_tool
from .tagged import Quoted, TaggedToolParser
from .think import Separators

OPEN = "<|tool_call>"
CLOSE = "<tool_call|>"
CHANNEL = "<|channel>"
THOUGHT_OPEN = CHANNEL + "thought"
THOUGHT_CLOSE = "<channel|>"
QUOTE = '<|"|>'
THOUGHT_SEPARATORS = Separators("\n", "\n", "")
_WS = " \t\r\n"


class _Syntax(ValueError):
    """The argument text is not Gemma object notation."""


class _Reader:
    """A recursive-descent reader bounded at MAX_JSON_DEPTH open objects and arrays (as
    ``loads_bounded`` is for JSON): deeper model output is a syntax error, so the call comes
    back as text instead of overflowing the stack here or in ``json.dumps``."""

    def __init__(self, text: str) -> None:
        self.text, self.pos, self.depth = text, 0, 0

    def enter(self, opener: str) -> None:
        self.expect(opener)
        self.depth += 1
        if self.depth > MAX_JSON_DEPTH:
            raise _Syntax(f"nested more than {MAX_JSON_DEPTH} levels deep at {self.pos}")

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1

    def peek(self, s: str) -> bool:
        self.skip_ws()
        return self.text.startswith(s, self.pos)

    def expect(self, s: str) -> None:
        if not self.peek(s):
            raise _Syntax(f"expected {s!r} at {self.pos}")
        self.pos += len(s)

    def value(self) -> Any:
        if self.peek("{"):
            return self.obj()
        if self.peek("["):
            return self.array()
        if self.peek(QUOTE):
            self.pos += len(QUOTE)
            end = self.text.find(QUOTE, self.pos)
            if end < 0:
                raise _Syntax("unterminated string")
            s, self.pos = self.text[self.pos : end], end + len(QUOTE)
            return s
        return self.bare()

    def bare(self) -> Any:
        """A number, true, false or null (a word that is none of them stays text)."""
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ",}]" + _WS:
            self.pos += 1
        word = self.text[start : self.pos]
        if not word:
            raise _Syntax(f"expected a value at {start}")
        try:
            return json.loads(word)
        except ValueError:
            return word

    def obj(self) -> dict[str, Any]:
        self.enter("{")
        out: dict[str, Any] = {}
        if self.peek("}"):
            self.pos += 1
            self.depth -= 1
            return out
        while True:
            self.skip_ws()
            if self.peek(QUOTE):  # a quoted key
                key = self.value()
            else:
                colon = self.text.find(":", self.pos)
                if colon < 0:
                    raise _Syntax("a key without ':'")
                key, self.pos = self.text[self.pos : colon].strip(), colon
            self.expect(":")
            out[str(key)] = self.value()
            if self.peek(","):
                self.pos += 1
                continue
            self.expect("}")
            self.depth -= 1
            return out

    def array(self) -> list[Any]:
        self.enter("[")
        out: list[Any] = []
        if self.peek("]"):
            self.pos += 1
            self.depth -= 1
            return out
        while True:
            out.append(self.value())
            if self.peek(","):
                self.pos += 1
                continue
            self.expect("]")
            self.depth -= 1
            return out


def parse_arguments(text: str) -> dict[str, Any]:
    """``{key:value,...}`` in Gemma notation -> a dict (ValueError when it is not one, or
    nests deeper than MAX_JSON_DEPTH)."""
    r = _Reader(text)
    try:
        args = r.obj()
    except RecursionError:  # not reached under the depth bound; kept as a backstop
        raise _Syntax("nested too deeply") from None
    r.skip_ws()
    if r.pos != len(text):
        raise _Syntax(f"trailing text at {r.pos}")
    return args


def decode_gemma_body(body: str) -> tuple[str, str] | None:
    head = body.lstrip()
    if not head.startswith("call:"):
        return None
    brace = head.find("{")
    name = head[len("call:") : brace if brace >= 0 else len(head)].strip()
    if not name:
        return None
    try:
        args = parse_arguments(head[brace:]) if brace >= 0 else {}
        return name, json.dumps(args, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None  # given back as text, as malformed output is


def close_partial(text: str) -> str:
    """Gemma notation cut by the token limit, closed: an open string gets its quote, open
    arrays and objects their brackets (a marker cut in the middle is dropped first)."""
    for k in range(len(QUOTE) - 1, 0, -1):  # "<|" or '<|"' at the very end
        if text.endswith(QUOTE[:k]):
            text = text[:-k]
            break
    stack: list[str] = []
    pos, in_string = 0, False
    while pos < len(text):
        if text.startswith(QUOTE, pos):
            in_string, pos = not in_string, pos + len(QUOTE)
            continue
        ch = text[pos]
        if not in_string and ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif not in_string and ch in "}]" and stack:
            stack.pop()
        pos += 1
    return text + (QUOTE if in_string else "") + "".join(reversed(stack))


def _partial_arguments(text: str) -> dict[str, Any]:
    """The members of a cut ``{...}`` that parse: each try drops the text after the last
    separator (a dangling key, a cut bare word); bounded for a hostile text."""
    for _ in range(64):
        try:
            return parse_arguments(close_partial(text))
        except ValueError:
            cut = max(text.rfind(","), text.rfind("{"), text.rfind("["))
            if cut <= 0:
                return {}
            text = text[:cut] if text[cut] == "," else text[: cut + 1]
    return {}


def decode_gemma_partial(body: str, tools: ToolSchemas) -> tuple[str, str] | None:
    """(name, arguments so far as a JSON object) of a call cut by the token limit; a name cut
    short is the one tool it begins, a call cut before its name the only tool when there is
    one."""
    head = body.lstrip()
    brace = head.find("{")
    if brace < 0:
        prefix = head[len("call:") :].strip() if head.startswith("call:") else ""
        if not prefix:
            return (
                (next(iter(tools)), "{}")
                if len(tools) == 1 and "call:".startswith(head[:5])
                else None
            )
        name = prefix if prefix in tools else unique_tool(prefix, tools)
        return (name, "{}") if name else None
    decoded = decode_gemma_body(head)
    if decoded is not None:
        return decoded
    name = head[len("call:") : brace].strip() if head.startswith("call:") else ""
    if not name:
        return None
    try:
        return name, json.dumps(_partial_arguments(head[brace:]), ensure_ascii=False)
    except RecursionError:
        return name, "{}"


def make_parser(tools: ToolSchemas) -> TaggedToolParser:
    # the notation carries its own types; the tools name a call cut short
    return TaggedToolParser(
        decode_gemma_body,
        OPEN,
        CLOSE,
        decode_partial=lambda b: decode_gemma_partial(b, tools),
        quoted=(Quoted(QUOTE, QUOTE),),
    )
