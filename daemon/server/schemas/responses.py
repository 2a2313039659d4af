"""Request body of the OpenAI Responses API (what Codex and OpenCode's Responses provider send).

Input items are heterogeneous (messages, ``function_call``, ``function_call_output``,
``reasoning``, ...); one permissive Struct with optional fields holds them all and the
translator dispatches on ``type``/``role``, so an item kind we do not know is skipped rather
than rejected.
"""

from __future__ import annotations

from typing import Any

import msgspec


class InputPart(msgspec.Struct, omit_defaults=True):
    """``input_text`` / ``output_text`` / ``summary_text`` / ``reasoning_text`` / images."""

    type: str = "input_text"
    text: str | None = None


class InputItem(msgspec.Struct, omit_defaults=True):
    type: str | None = None  # "message" when absent and a role is given
    role: str | None = None
    content: str | list[InputPart] | None = None
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    summary: list[InputPart] | None = None
    status: str | None = None


class ResponsesTool(msgspec.Struct, omit_defaults=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[ResponsesTool] | None = None  # a "namespace" tool's members


class ResponsesToolChoice(msgspec.Struct, omit_defaults=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, omit_defaults=True):
    type: str = "text"  # text | json_object | json_schema
    name: str | None = None
    json_schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(msgspec.Struct, omit_defaults=True):
    format: TextFormat | None = None


class ReasoningConfig(msgspec.Struct, omit_defaults=True):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    top_logprobs: int | None = None
