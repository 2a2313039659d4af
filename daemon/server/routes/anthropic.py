"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API (Claude Code).

Accepts what Claude Code sends: ``?beta=true``, unknown fields, system as blocks with
``cache_control``, ``role: system`` messages in mid-conversation, tool_result blocks with
``is_error``. Claude Code's first system block is a per-prompt billing line; it is dropped so
it does not defeat prefix caching across conversations.
"""

from __future__ import annotations

import json
import time
from typing import Any

from litestar import Request, Response, post

from ..chat import ChatRequest, Sampling, ToolSpec, assistant_tool_call, check_tool
from ..errors import InvalidRequest
from ..limits import json_shape
from ..openapi import body_operation
from ..schemas.anthropic import Block, CountTokensRequest, Message, MessagesRequest
from ..sse import anthropic_ping
from ..state import server_state
from .anthropic_out import MessagesOutput
from .common import decode_body, respond

BILLING_PREFIX = "x-anthropic-billing-header"


def blocks_text(content: str | list[Block] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(b.text or "" for b in content if b.type == "text")


def system_text(system: str | list[Block] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = [b.text or "" for b in system if b.type == "text"]
    return "\n\n".join(t for t in texts if t and not t.startswith(BILLING_PREFIX))


def _user_messages(msg: Message, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results become tool messages (first), then its text."""
    if isinstance(msg.content, str):
        return [{"role": "user", "content": msg.content}]
    out: list[dict[str, Any]] = []
    for j, block in enumerate(msg.content):
        if block.type == "tool_result":
            if not block.tool_use_id:
                raise InvalidRequest(
                    f"{where}.content[{j}].tool_use_id is required", param=f"{where}.content[{j}]"
                )
            text = blocks_text(block.content)
            if block.is_error:
                text = f"[error] {text}"
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
    text = blocks_text(msg.content)
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _assistant_message(msg: Message, where: str) -> dict[str, Any]:
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    out: dict[str, Any] = {"role": "assistant", "content": blocks_text(msg.content)}
    thinking = "".join(b.thinking or "" for b in msg.content if b.type == "thinking")
    if thinking:
        out["reasoning_content"] = thinking
    calls = []
    for j, b in enumerate(msg.content):
        if b.type == "tool_use":
            if not b.name:
                raise InvalidRequest(
                    f"{where}.content[{j}].name is required", param=f"{where}.content[{j}]"
                )
            args = b.input if isinstance(b.input, dict) else {}
            json_shape(args, f"{where}.content[{j}].input")  # deep input: 400, not a crash
            calls.append(assistant_tool_call(b.id or f"toolu_{j}", b.name, json.dumps(args)))
    if calls:
        out["tool_calls"] = calls
    return out


def convert_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    if not body.messages:
        raise InvalidRequest("messages: at least one message is required", param="messages")
    out: list[dict[str, Any]] = []
    system = system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(body.messages):
        where = f"messages.{i}"
        if msg.role == "user":
            out.extend(_user_messages(msg, where))
        elif msg.role == "assistant":
            out.append(_assistant_message(msg, where))
        elif msg.role == "system":  # a beta Claude Code uses in mid-conversation
            out.append({"role": "system", "content": blocks_text(msg.content)})
        else:
            raise InvalidRequest(
                f"{where}.role: unexpected role {msg.role!r}; use 'user' or 'assistant'",
                param=f"{where}.role",
            )
    return out


def convert_tools(body: CountTokensRequest) -> list[ToolSpec]:
    specs = []
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            continue  # server tools (web_search_..., bash_...): accepted and dropped
        name, params = check_tool(tool.name, tool.input_schema, f"tools.{i}")
        specs.append(ToolSpec(name, tool.description, params))
    return specs


def to_chat_request(body: CountTokensRequest, sampling: Sampling) -> ChatRequest:
    tools = convert_tools(body)
    choice, forced = "auto", None
    if body.tool_choice is not None:
        kind = body.tool_choice.type
        if kind == "any":
            choice = "required" if tools else "auto"
        elif kind == "none":
            choice = "none"
        elif kind == "tool":
            if body.tool_choice.name not in {t.name for t in tools}:
                raise InvalidRequest(
                    f"tool_choice.name {body.tool_choice.name!r} is not in tools",
                    param="tool_choice.name",
                )
            choice, forced = "function", body.tool_choice.name
        elif kind != "auto":
            raise InvalidRequest(
                f"tool_choice.type {kind!r} is not supported", param="tool_choice.type"
            )
    thinking = None
    if body.thinking is not None and body.thinking.type == "disabled":
        thinking = False
    parallel = not (body.tool_choice and body.tool_choice.disable_parallel_tool_use)
    return ChatRequest(
        messages=convert_messages(body),
        sampling=sampling,
        tools=tools,  # "none" keeps them in the prompt (same prefix as other turns)
        tool_choice=choice,
        forced_tool=forced,
        parallel_tool_calls=parallel,
        thinking=thinking,
    )


def sampling_of(body: MessagesRequest) -> Sampling:
    return Sampling(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=list(body.stop_sequences or []),
    )


@post("/v1/messages", status_code=200, operation_class=body_operation(MessagesRequest))
async def messages(request: Request[Any, Any, Any]) -> Response[Any]:
    started = time.monotonic()
    state = server_state(request)
    state.check_intake()
    body = await decode_body(request, MessagesRequest)
    svc = state.service
    svc.check_model(body.model)
    req = to_chat_request(body, sampling_of(body))
    gen, _ = await svc.start_chat(req)
    out = MessagesOutput(gen, svc.name)

    return await respond(request, "messages", gen, out, started, body.stream, ping=anthropic_ping)


@post(
    "/v1/messages/count_tokens",
    status_code=200,
    operation_class=body_operation(CountTokensRequest),
)
async def count_tokens(request: Request[Any, Any, Any]) -> dict[str, int]:
    state = server_state(request)
    state.check_intake()
    body = await decode_body(request, CountTokensRequest)
    state.service.check_model(body.model)
    req = to_chat_request(body, Sampling(max_tokens=1))
    return {"input_tokens": await state.service.count_tokens(req)}
