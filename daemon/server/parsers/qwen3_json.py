"""Qwen3 JSON tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(Qwen3 MoE, Qwen2.5, and templates that instruct this form)."""

from __future__ import annotations

import json
import re

from .base import ToolSchemas, loads_bounded, unique_tool
from .tagged import JSON_STRINGS, TaggedToolParser


def decode_json_body(body: str) -> tuple[str, str] | None:
    try:
        obj = loads_bounded(body)  # raw control chars in strings happen
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        # some models double-encode; keep it if it is itself an object
        try:
            args = loads_bounded(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_CUT_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)$')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def decode_json_partial(body: str, tools: ToolSchemas) -> tuple[str, str] | None:
    """(name, arguments text so far) of a call cut by the token limit."""
    full = decode_json_body(body)
    if full is not None:
        return full
    named = _NAME.search(body)
    if named is None:
        cut = _CUT_NAME.search(body)
        if cut is not None:
            name = unique_tool(cut.group(1), tools)
        else:
            name = next(iter(tools)) if len(tools) == 1 else None
        return (name, "{}") if name else None
    try:
        name = json.loads(f'"{named.group(1)}"')
    except ValueError:
        return None
    args = _ARGS.search(body, named.end())
    return name, body[args.end() :].strip() if args else "{}"


def make_parser(tools: ToolSchemas) -> TaggedToolParser:
    return TaggedToolParser(
        decode_json_body,
        decode_partial=lambda body: decode_json_partial(body, tools),
        quoted=JSON_STRINGS,
        # content + '\n' + call + '\n' + call (the built-in model's and Qwen3's templates)
        separators=("\n", "\n"),
    )
