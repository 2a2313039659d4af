"""MiniMax-M2 / M2.5 tool calls: one block holding one or more invocations::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Oslo</parameter>
    <parameter name="filters">{"days": 2}</parameter>
    </invoke>
    <invoke name="get_time">
    <parameter name="zone">CET</parameter>
    </invoke>
    </minimax:tool_call>

Values are text, converted by the tool's schema as for the other XML syntaxes (strings
verbatim, anything else decoded as JSON, falling back to the text). Nothing pads a value (the
template writes ``<parameter name="K">`` + value + ``</parameter>``): a string keeps its leading
and trailing whitespace, a file's final newline included. Output written under a forced call's
grammar is read with ``padded``: xgrammar's style may put one whitespace character on each side
of a value, which is stripped there.
A value ends at its ``</parameter>``: the other tags are text inside it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import ToolSchemas, unique_tool
from .qwen3_xml import convert_value, schema_types, strip_padding
from .tagged import Quoted, TaggedToolParser

OPEN = "<minimax:tool_call>"
CLOSE = "</minimax:tool_call>"
TAGS = ("<invoke", "</invoke>", "<parameter", "</parameter>")
_QUOTED = (Quoted("<parameter name=", "</parameter>"),)
# read left to right: an invocation's start, or a whole parameter (its value consumed, so tags
# inside it are not seen; a value that lacks its </parameter> ends at </invoke>); </invoke>
# needs no match, the next invocation starts afresh
_INVOKE_OR_PARAMETER = r"<invoke name=\"([^\"\n]+)\">|<parameter name=\"([^\"\n]+)\">(.*?)"
_ITEM = re.compile(
    _INVOKE_OR_PARAMETER + r"(?:</parameter>|(?=</invoke>)(?!.*</parameter>)|$)", re.S
)
_CUT_ITEM = re.compile(_INVOKE_OR_PARAMETER + r"(?:</parameter>|$)", re.S)  # a </invoke> is text


def decode_minimax_block(
    body: str, tools: ToolSchemas, closed: bool = True, padded: bool = False
) -> list[tuple[str, str]] | None:
    """``closed=False``: a block cut by the token limit (the last value's </invoke> not
    written yet: one in it is the value's text). ``padded``: a grammar wrote it (one whitespace
    character on each side of a value is padding)."""
    calls: list[tuple[str, dict[str, Any]]] = []
    for m in (_ITEM if closed else _CUT_ITEM).finditer(body):
        if m.group(1) is not None:
            calls.append((m.group(1).strip(), {}))
        elif calls:  # a parameter outside any invocation is not part of a call
            name, args = calls[-1]
            key = m.group(2).strip()
            value = strip_padding(m.group(3)) if padded else m.group(3)
            args[key] = convert_value(value, schema_types(tools.get(name), key))
    return [(name, json.dumps(args, ensure_ascii=False)) for name, args in calls] or None


_CUT_NAME = re.compile(r"<invoke name=\"([^\"\n]*)\"?$")  # cut inside an invocation's tag
_CUT_TAG = re.compile(r"<[^<>]*$")  # any other tag cut at the very end


def decode_minimax_partial(
    body: str, tools: ToolSchemas, padded: bool = False
) -> list[tuple[str, str]] | None:
    """The block's calls so far, the last one cut by the token limit (its arguments as far as
    they were written); a name cut short is the one tool it begins, and a block cut before
    its first invocation is the only tool when there is one."""
    cut = _CUT_NAME.search(body)
    text = _CUT_TAG.sub("", body[: cut.start()] if cut else body)
    calls = decode_minimax_block(text, tools, closed=False, padded=padded)
    calls = calls or []
    if cut is not None:
        name = unique_tool(cut.group(1), tools)
        if name:
            calls.append((name, "{}"))
    elif not calls and len(tools) == 1:
        calls.append((next(iter(tools)), "{}"))
    return calls or None


def make_parser(tools: ToolSchemas, padded: bool = False) -> TaggedToolParser:
    return TaggedToolParser(
        lambda body: decode_minimax_block(body, tools, padded=padded),
        OPEN,
        CLOSE,
        decode_partial=lambda body: decode_minimax_partial(body, tools, padded),
        quoted=_QUOTED,
        # content + '\n' + block (MiniMax-M2's template, which writes one block per message)
        separators=("\n", "\n"),
    )
