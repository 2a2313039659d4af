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

from .base import ToolSchemas
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


def make_parser(tools: ToolSchemas) -> TaggedToolParser:
    return TaggedToolParser(lambda body: decode_minimax_block(body, tools), OPEN, CLOSE)
