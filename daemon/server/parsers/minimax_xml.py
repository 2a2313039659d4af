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
verbatim, anything else decoded as JSON, falling back to the text). One whitespace character on
each side of a value is padding, as for Qwen's XML (the forced-call grammar may put one there).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import ToolSchemas, unique_tool
from .qwen3_xml import convert_value, schema_types, strip_padding
from .tagged import TaggedToolParser

OPEN = "<minimax:tool_call>"
CLOSE = "</minimax:tool_call>"
_INVOKE = re.compile(r"<invoke name=\"([^\"\n]+)\">(.*?)(?:</invoke>|$)", re.S)
_PARAMETER = re.compile(r"<parameter name=\"([^\"\n]+)\">(.*?)(?:</parameter>|$)", re.S)


def decode_minimax_block(body: str, tools: ToolSchemas) -> list[tuple[str, str]] | None:
    calls = []
    for inv in _INVOKE.finditer(body):
        name = inv.group(1).strip()
        schema = tools.get(name)
        args: dict[str, Any] = {}
        for pm in _PARAMETER.finditer(inv.group(2)):
            key = pm.group(1).strip()
            args[key] = convert_value(strip_padding(pm.group(2)), schema_types(schema, key))
        calls.append((name, json.dumps(args, ensure_ascii=False)))
    return calls or None


_CUT_NAME = re.compile(r"<invoke name=\"([^\"\n]*)\"?$")  # cut inside an invocation's tag
_CUT_TAG = re.compile(r"<[^<>]*$")  # any other tag cut at the very end


def decode_minimax_partial(body: str, tools: ToolSchemas) -> list[tuple[str, str]] | None:
    """The block's calls so far, the last one cut by the token limit (its arguments as far as
    they were written); a name cut short is the one tool it begins, and a block cut before
    its first invocation is the only tool when there is one."""
    cut = _CUT_NAME.search(body)
    calls = decode_minimax_block(_CUT_TAG.sub("", body[: cut.start()] if cut else body), tools)
    calls = calls or []
    if cut is not None:
        name = unique_tool(cut.group(1), tools)
        if name:
            calls.append((name, "{}"))
    elif not calls and len(tools) == 1:
        calls.append((next(iter(tools)), "{}"))
    return calls or None


def make_parser(tools: ToolSchemas) -> TaggedToolParser:
    return TaggedToolParser(
        lambda body: decode_minimax_block(body, tools),
        OPEN,
        CLOSE,
        decode_partial=lambda body: decode_minimax_partial(body, tools),
    )
