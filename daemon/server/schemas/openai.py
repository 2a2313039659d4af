"""Request bodies of the OpenAI Chat Completions and Completions APIs.

Permissive on purpose: msgspec ignores unknown fields (clients send many extensions), every
field a client may leave out has a default, and unions are as loose as the wire allows
(``content`` may be a string, a list of parts, null or an empty string). Value checks that
msgspec's types cannot express live in the request translators, which name the field.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ContentPart(msgspec.Struct, omit_defaults=True):
    """One part of a multi-part content; only text parts reach the model."""

    type: str = "text"
    text: str | None = None


class FunctionCall(msgspec.Struct, omit_defaults=True):
    name: str
    # The spec says a JSON string; some clients send the object itself.
    arguments: str | dict[str, Any] = "{}"


class ToolCall(msgspec.Struct, omit_defaults=True):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Echoed reasoning from an earlier assistant turn (two spellings in the wild).
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(msgspec.Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, omit_defaults=True):
    type: str = "function"
    function: FunctionDef | None = None


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    function: NamedFunction
    type: str = "function"


class JsonSchemaSpec(msgspec.Struct, omit_defaults=True):
    name: str = "response"
    # `schema` is a keyword-ish name in msgspec; map it explicitly.
    json_schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, omit_defaults=True):
    type: str = "text"  # text | json_object | json_schema
    json_schema: JsonSchemaSpec | None = None


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Sampling knobs shared by chat and completions (vLLM-style extensions included)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # vLLM's: logprobs name each token "token_id:<id>" rather than by its text, so tokens whose
    # text is not unique (byte-level tokens all decode to U+FFFD) stay apart
    return_tokens_as_token_ids: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None  # accepted, not applied
    frequency_penalty: float | None = None  # accepted, not applied
    user: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    model: str
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    model: str
    # str, list[int] (token ids), or a one-element list of either; checked by the route
    # because msgspec unions hold one list type.
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
