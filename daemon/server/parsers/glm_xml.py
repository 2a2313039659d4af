"""GLM-4.5 / 4.6 / 4.7 tool calls: the function name, then key/value pairs::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Oslo</arg_value>
    <arg_key>filters</arg_key>
    <arg_value>{"days": 2}</arg_value>
    </tool_call>

(GLM-4.7 writes the same without the newlines.) The chat template writes string values
verbatim and every other value as JSON, so a value is kept as text when the tool's schema says
string and decoded as JSON otherwise (falling back to the text). Nothing pads a value (unlike
Qwen's XML, whose template writes it on a line of its own): a string keeps its leading and
trailing whitespace, a file's final newline included. Output written under a forced call's
grammar is read with ``padded``: xgrammar's style may put one whitespace character on each side
of a value, which is stripped there.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import ToolSchemas, unique_tool
from .qwen3_xml import convert_value, schema_types, strip_padding
from .tagged import Quoted, TaggedToolParser

TAGS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
# keys and values are text up to their closing tags: a </tool_call> in them does not end the call
_QUOTED = (Quoted("<arg_key>", "</arg_key>"), Quoted("<arg_value>", "</arg_value>"))
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)


def decode_glm_body(body: str, tools: ToolSchemas, padded: bool = False) -> tuple[str, str] | None:
    head, sep, _ = body.partition("<arg_key>")
    name = head.strip()
    if not name or "<" in name or "\n" in name:
        return None
    schema = tools.get(name)
    args: dict[str, Any] = {}
    for m in _PAIR.finditer(body[len(head) :] if sep else ""):
        key = m.group(1).strip()
        value = strip_padding(m.group(2)) if padded else m.group(2)
        args[key] = convert_value(value, schema_types(schema, key))
    return name, json.dumps(args, ensure_ascii=False)


_CUT_TAG = re.compile(r"<[^<>]*$")  # a tag the token limit cut, at the very end


def decode_glm_partial(
    body: str, tools: ToolSchemas, padded: bool = False
) -> tuple[str, str] | None:
    """(name, arguments so far as a JSON object) of a call cut by the token limit: pairs whose
    value began are kept (the last value as far as it was written); a name cut short is the one
    tool it begins, and a call cut before its name is the only tool when there is one."""
    body = _CUT_TAG.sub("", body)
    head, sep, _ = body.partition("<arg_key>")
    if not sep and "\n" not in head.lstrip():  # the name itself may be cut
        prefix = head.strip()
        if not prefix:
            return (next(iter(tools)), "{}") if len(tools) == 1 else None
        name = prefix if prefix in tools else unique_tool(prefix, tools)
        return (name, "{}") if name else None
    return decode_glm_body(body, tools, padded)


def make_parser(tools: ToolSchemas, padded: bool = False) -> TaggedToolParser:
    return TaggedToolParser(
        lambda body: decode_glm_body(body, tools, padded),
        decode_partial=lambda body: decode_glm_partial(body, tools, padded),
        quoted=_QUOTED,
        # GLM-4.5 / 4.6 write '\n' before each call (4.7 nothing: no separator to drop there)
        separators=("\n", "\n"),
    )
