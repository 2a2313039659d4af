"""POST /v1/chat/completions: the OpenAI Chat Completions API."""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, post

from ..chat import (
    ChatRequest,
    Sampling,
    ToolSpec,
    assistant_tool_call,
    check_role,
    check_tool,
)
from ..errors import InvalidRequest
from ..openapi import body_operation
from ..schemas.openai import ChatCompletionRequest, ChatMessage, ContentPart
from ..state import server_state
from .common import decode_body, respond
from .openai_chat_out import ChatOutput


def content_text(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text or "" for p in content if p.type in ("text", "input_text"))


def convert_message(m: ChatMessage, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    role = "tool" if m.role == "function" else check_role(m.role, f"{where}.role")
    out: dict[str, Any] = {"role": role, "content": content_text(m.content)}
    if role == "assistant":
        reasoning = m.reasoning_content or m.reasoning
        if reasoning:
            out["reasoning_content"] = reasoning
        if m.tool_calls:
            out["tool_calls"] = [
                assistant_tool_call(
                    tc.id or f"call_{i}_{j}", tc.function.name, tc.function.arguments
                )
                for j, tc in enumerate(m.tool_calls)
            ]
    elif role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
        if m.name:
            out["name"] = m.name
    return out


def convert_tools(body: ChatCompletionRequest) -> list[ToolSpec]:
    specs = []
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function":
            continue  # built-in tool kinds we cannot run: dropped, never a 400
        if tool.function is None:
            raise InvalidRequest(f"tools[{i}].function is required", param=f"tools[{i}].function")
        fn = tool.function
        name, params = check_tool(fn.name, fn.parameters, f"tools[{i}].function")
        specs.append(ToolSpec(name, fn.description, params))
    return specs


def convert_tool_choice(
    body: ChatCompletionRequest, tools: list[ToolSpec]
) -> tuple[str, str | None]:
    choice = body.tool_choice
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequest(
                f"tool_choice must be auto, none, required or a named function, got {choice!r}",
                param="tool_choice",
            )
        if choice == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
        return choice, None
    name = choice.function.name
    if name not in {t.name for t in tools}:
        raise InvalidRequest(
            f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    return "function", name


def to_chat_request(body: ChatCompletionRequest) -> ChatRequest:
    if body.n != 1:
        raise InvalidRequest("n: only n=1 is supported", param="n")
    if not body.messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    tools = convert_tools(body)
    choice, forced = convert_tool_choice(body, tools)
    fmt, schema = "text", None
    if body.response_format is not None:
        fmt = body.response_format.type
        if fmt not in ("text", "json_object", "json_schema"):
            raise InvalidRequest(
                f"response_format.type must be text, json_object or json_schema, got {fmt!r}",
                param="response_format.type",
            )
        if fmt == "json_schema":
            spec = body.response_format.json_schema
            if spec is None or spec.json_schema is None:
                raise InvalidRequest(
                    "response_format.json_schema.schema is required",
                    param="response_format.json_schema",
                )
            schema = spec.json_schema
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    kwargs = body.chat_template_kwargs or {}
    thinking = kwargs.get("enable_thinking")
    return ChatRequest(
        messages=[convert_message(m, i) for i, m in enumerate(body.messages)],
        sampling=Sampling(
            max_tokens=body.max_completion_tokens or body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            stop=stop,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        ),
        tools=tools,  # "none" keeps them in the prompt (same prefix as other turns)
        tool_choice=choice,
        forced_tool=forced,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        output_format=fmt,
        output_schema=schema,
        thinking=thinking if isinstance(thinking, bool) else None,
    )


@post(
    "/v1/chat/completions",
    status_code=200,
    operation_class=body_operation(ChatCompletionRequest),
)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    started = time.monotonic()
    state = server_state(request)
    state.check_intake()
    body = await decode_body(request, ChatCompletionRequest)
    svc = state.service
    svc.check_model(body.model)
    req = to_chat_request(body)
    gen, _ = await svc.start_chat(req)
    out = ChatOutput(
        gen,
        svc.name,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        as_ids=body.return_tokens_as_token_ids,
    )

    return await respond(request, "chat", gen, out, started, body.stream)
