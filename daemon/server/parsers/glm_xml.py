"""GLM-4.5 / 4.6 / 4.7 tool calls: the function name, then key/value pairs::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Oslo</arg_value>
    <arg_key>filters</arg_key>
    <arg_value>{"days": 2}</arg_value>
    </tool_call>

(GLM-4.7 writes the same without the newlines.) The chat template writes string values
verbatim and every other value as JSON, so a value is kept as text when the tool's schema says
string and decoded as JSON otherwise (falling back to the text). One whitespace character on
each side of a value is padding, as for Qwen's XML (the forced-call grammar may put one there).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import ToolSchemas
from .qwen3_xml import convert_value, schema_types, strip_padding
from .tagged import TaggedToolParser

_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)


def decode_glm_body(body: str, tools: ToolSchemas) -> tuple[str, str] | None:
    head, sep, _ = body.partition("<arg_key>")
    name = head.strip()
    if not name or "<" in name or "\n" in name:
        return None
    schema = tools.get(name)
    args: dict[str, Any] = {}
    for m in _PAIR.finditer(body[len(head) :] if sep else ""):
        key = m.group(1).strip()
        args[key] = convert_value(strip_padding(m.group(2)), schema_types(schema, key))
    return name, json.dumps(args, ensure_ascii=False)


def make_parser(tools: ToolSchemas) -> TaggedToolParser:
    return TaggedToolParser(lambda body: decode_glm_body(body, tools))
