"""Qwen3.5 / Qwen3.6 / Qwen3-Coder XML tool calls::

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

Values are raw text; the tool's JSON schema says which are strings (kept verbatim) and which
are numbers, booleans, arrays or objects (decoded as JSON, falling back to the text). A value
ends at ``</parameter>`` (or, when a model leaves that out, at the next ``<parameter=``): the
other tags are text inside it, so the function's body runs to its LAST ``</function>``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import ToolSchemas, loads_bounded, unique_tool
from .tagged import Quoted, TaggedToolParser

TAGS = ("<function=", "</function>", "<parameter=", "</parameter>")
_QUOTED = (Quoted("<parameter=", "</parameter>"),)
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


_PAD = " \t\r\n"


def strip_padding(value: str) -> str:
    """Drop ONE whitespace character on each side: models write ``>\nvalue\n<``, and the
    forced-call grammar allows one padding character there; more is part of the value."""
    if value[:1] in _PAD and value:
        value = value[1:]
    if value[-1:] in _PAD and value:
        value = value[:-1]
    return value


def schema_types(schema: dict[str, Any] | None, param: str) -> set[str]:
    if not schema:
        return set()
    prop = (schema.get("properties") or {}).get(param) or {}
    kind = prop.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return set()


def convert_value(raw: str, types: set[str]) -> Any:
    """A parameter's text as the JSON value its schema asks for."""
    if types == {"string"} or (not types and not raw.strip()):
        return raw
    try:
        return loads_bounded(raw)
    except ValueError:
        return raw


def decode_xml_body(body: str, tools: ToolSchemas, closed: bool = True) -> tuple[str, str] | None:
    """``closed=False``: a body cut by the token limit (its </function> not written yet: one
    in it is a value's text)."""
    match = _FUNCTION.search(body)
    if match is None:
        return None
    name = match.group(1).strip()
    schema = tools.get(name)
    end = body.rfind("</function>") if closed else -1
    inner = body[match.end() : end if end >= match.end() else len(body)]
    args: dict[str, Any] = {}
    for pm in _PARAMETER.finditer(inner):
        key = pm.group(1).strip()
        args[key] = convert_value(strip_padding(pm.group(2)), schema_types(schema, key))
    return name, json.dumps(args, ensure_ascii=False)


# a tag the token limit cut in the middle, at the very end of the text
_CUT_TAG = re.compile(r"<(?:/?[A-Za-z_]*|parameter=[^>\n]*|function=[^>\n]*)$")
_CUT_FUNCTION = re.compile(r"<function=([^>\n]*)$")


def decode_xml_partial(body: str, tools: ToolSchemas) -> tuple[str, str] | None:
    """(name, arguments so far as a JSON object) of a call cut by the token limit."""
    if _FUNCTION.search(body) is None:
        cut = _CUT_FUNCTION.search(body)
        if cut is not None:  # cut inside the tool's name
            name = unique_tool(cut.group(1).strip(), tools)
            return (name, "{}") if name else None
        # cut before the name: one tool can only be that one
        return (next(iter(tools)), "{}") if len(tools) == 1 else None
    return decode_xml_body(_CUT_TAG.sub("", body), tools, closed=False)


def make_parser(tools: ToolSchemas) -> TaggedToolParser:
    return TaggedToolParser(
        lambda body: decode_xml_body(body, tools),
        decode_partial=lambda body: decode_xml_partial(body, tools),
        quoted=_QUOTED,
        # content + '\n\n' + call + '\n' + call (Qwen3.5's and Qwen3-Coder's templates)
        separators=("\n\n", "\n"),
    )
