"""Qwen3 JSON tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(Qwen3 MoE, Qwen2.5, and templates that instruct this form)."""

from __future__ import annotations

import json

from .base import ToolSchemas, loads_bounded
from .tagged import TaggedToolParser


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


def make_parser(tools: ToolSchemas) -> TaggedToolParser:
    del tools  # JSON carries its own types
    return TaggedToolParser(decode_json_body)
