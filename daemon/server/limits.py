"""Size, count and depth limits on what a request may carry, checked before any costly work.

Each limit is far above what agent clients send (Claude Code: ~100 messages, ~40 tools whose
schemas nest 5-8 levels) and far below what would hurt the daemon: deep JSON overflows the
Python stack in the template, the parsers and the grammar compiler; thousands of tools or
schema nodes make grammar compilation and rendering slow for everyone. Every check here is
iterative (no recursion), so a value nested 100,000 levels deep is refused, not crashed on.
"""

from __future__ import annotations

from typing import Any

from .errors import InvalidRequest

MAX_MESSAGES = 10_000  # messages (or Responses input items) in one request
MAX_TOOLS = 256  # tool definitions in one request
MAX_JSON_DEPTH = 64  # nesting of any free-form JSON value (schemas, arguments, content)
MAX_SCHEMA_NODES = 20_000  # objects, arrays and scalars in one JSON schema
MAX_TOOL_SCHEMA_NODES = 200_000  # the same over all the tools of a request
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1_000  # one stop string; the stop checker holds back this much text


def json_shape(value: Any, where: str, max_depth: int = MAX_JSON_DEPTH) -> int:
    """The number of nodes in ``value`` (dicts, lists and scalars); InvalidRequest naming
    ``where`` when it nests deeper than ``max_depth``."""
    nodes = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > max_depth:
            raise InvalidRequest(
                f"{where}: JSON nested more than {max_depth} levels deep", param=where
            )
        stack.extend((child, depth + 1) for child in children)
    return nodes


def check_schema(schema: Any, where: str) -> int:
    """Depth and size of one JSON schema; returns its node count."""
    nodes = json_shape(schema, where)
    if nodes > MAX_SCHEMA_NODES:
        raise InvalidRequest(
            f"{where}: the JSON schema has {nodes} nodes, more than {MAX_SCHEMA_NODES}",
            param=where,
        )
    return nodes


def check_counts(n_messages: int, n_tools: int, messages_field: str = "messages") -> None:
    if n_messages > MAX_MESSAGES:
        raise InvalidRequest(
            f"{messages_field}: {n_messages} messages, more than {MAX_MESSAGES}",
            param=messages_field,
        )
    if n_tools > MAX_TOOLS:
        raise InvalidRequest(f"tools: {n_tools} tools, more than {MAX_TOOLS}", param="tools")


def check_chat(req: Any) -> None:
    """Every limit of a ChatRequest (messages, tools, schemas, stops), before rendering."""
    check_counts(len(req.messages), len(req.tools))
    json_shape(req.messages, "messages")
    total = 0
    for i, tool in enumerate(req.tools):
        total += check_schema(tool.parameters, f"tools[{i}].parameters")
    if total > MAX_TOOL_SCHEMA_NODES:
        raise InvalidRequest(
            f"tools: the tool schemas have {total} nodes in all, more than {MAX_TOOL_SCHEMA_NODES}",
            param="tools",
        )
    if req.output_schema is not None:
        check_schema(req.output_schema, "response_format")
    check_stops(req.sampling.stop)


def check_stops(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS or any(not x for x in stop):
        raise InvalidRequest(
            f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", param="stop"
        )
    if any(len(x) > MAX_STOP_CHARS for x in stop):
        raise InvalidRequest(
            f"stop: each stop string is at most {MAX_STOP_CHARS} characters", param="stop"
        )
