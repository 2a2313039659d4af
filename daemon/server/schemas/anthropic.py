"""Request bodies of the Anthropic Messages API (what Claude Code sends).

Unknown fields (``context_management``, ``output_config``, ``cache_control``, ...) are ignored
by msgspec. Content blocks are one permissive Struct keyed by ``type``; the translator keeps
text, tool_use, tool_result and thinking blocks and skips the rest.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Block(msgspec.Struct, omit_defaults=True):
    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: Any = None
    # tool_result: content is a string or a list of blocks
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    # thinking
    thinking: str | None = None
    signature: str | None = None


class Message(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | list[Block]


class Tool(msgspec.Struct, omit_defaults=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or a server tool ("web_search_20250305", ...)


class ToolChoice(msgspec.Struct, omit_defaults=True):
    type: str = "auto"  # auto | any | tool | none
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, omit_defaults=True):
    type: str = "enabled"  # enabled | disabled | adaptive
    budget_tokens: int | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, kw_only=True, omit_defaults=True):
    max_tokens: int
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
