"""POST /v1/responses: the OpenAI Responses API (Codex, OpenCode's Responses provider).

Stateless: the client resends the whole history each turn (Codex does, ``store: false``);
``previous_response_id`` is refused because nothing is stored.
"""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, post

from ..chat import ChatRequest, Sampling, ToolSpec, assistant_tool_call, check_role, check_tool
from ..errors import InvalidRequest
from ..openapi import body_operation
from ..schemas.responses import InputItem, InputPart, ResponsesRequest
from ..state import server_state
from .common import decode_body, respond
from .responses_out import ResponsesOutput

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def parts_text(content: str | list[InputPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text or "" for p in content if p.type in _TEXT_PARTS)


class _History:
    """Builds template messages from input items; function calls join the assistant turn
    before them, reasoning items attach to the assistant turn after them."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._reasoning: list[str] = []

    def _assistant(self) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self._reasoning:
            last = {"role": "assistant", "content": ""}
            self._attach_reasoning(last)
            self.messages.append(last)
        return last

    def _attach_reasoning(self, msg: dict[str, Any]) -> None:
        if self._reasoning:
            msg["reasoning_content"] = "\n".join(self._reasoning)
            self._reasoning = []

    def add(self, item: InputItem, i: int) -> None:
        where = f"input[{i}]"
        kind = item.type or ("message" if item.role else None)
        if kind == "message":
            role = check_role(item.role or "user", f"{where}.role")
            msg: dict[str, Any] = {"role": role, "content": parts_text(item.content)}
            if role == "assistant":
                self._attach_reasoning(msg)
            self.messages.append(msg)
        elif kind == "function_call":
            if not item.name:
                raise InvalidRequest(f"{where}.name is required", param=f"{where}.name")
            call_id = item.call_id or item.id or f"call_{i}"
            calls = self._assistant().setdefault("tool_calls", [])
            calls.append(assistant_tool_call(call_id, item.name, item.arguments or "{}"))
        elif kind == "function_call_output":
            output = parts_text(item.output) if not isinstance(item.output, str) else item.output
            self.messages.append(
                {"role": "tool", "tool_call_id": item.call_id or "", "content": output}
            )
        elif kind == "reasoning":
            text = parts_text(item.summary) or parts_text(item.content)
            if text:
                self._reasoning.append(text)
        # other item kinds (web_search_call, custom tool calls, ...) carry nothing we can render


def convert_tools(body: ResponsesRequest) -> list[ToolSpec]:
    specs = []
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function":
            continue  # namespace, web_search, custom, ...: accepted and dropped
        name, params = check_tool(tool.name, tool.parameters, f"tools[{i}]")
        specs.append(ToolSpec(name, tool.description, params))
    return specs


def convert_tool_choice(body: ResponsesRequest, tools: list[ToolSpec]) -> tuple[str, str | None]:
    choice = body.tool_choice
    if choice is None or not tools:
        return ("none" if choice == "none" else "auto"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequest(f"tool_choice {choice!r} is not supported", param="tool_choice")
        return choice, None
    if choice.type == "function":
        if choice.name not in {t.name for t in tools}:
            raise InvalidRequest(
                f"tool_choice names {choice.name!r}, which is not in tools", param="tool_choice"
            )
        return "function", choice.name
    return "auto", None  # allowed_tools, built-in tool kinds: left to the model


def to_chat_request(body: ResponsesRequest) -> ChatRequest:
    if body.previous_response_id:
        raise InvalidRequest(
            "previous_response_id is not supported (responses are not stored); "
            "send the full conversation in input",
            param="previous_response_id",
        )
    history = _History()
    if body.instructions:
        history.messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        history.messages.append({"role": "user", "content": body.input})
    else:
        for i, item in enumerate(body.input):
            history.add(item, i)
    if not history.messages:
        raise InvalidRequest("input must not be empty", param="input")
    tools = convert_tools(body)
    choice, forced = convert_tool_choice(body, tools)
    fmt = body.text.format if body.text and body.text.format else None
    out_format = fmt.type if fmt else "text"
    if out_format not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(
            f"text.format.type {out_format!r} is not supported", param="text.format.type"
        )
    if out_format == "json_schema" and (fmt is None or fmt.json_schema is None):
        raise InvalidRequest("text.format.schema is required", param="text.format.schema")
    effort = body.reasoning.effort if body.reasoning else None
    return ChatRequest(
        messages=history.messages,
        sampling=Sampling(
            max_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            logprobs=body.top_logprobs,
            max_tokens_field="max_output_tokens",
        ),
        tools=tools,  # "none" keeps them in the prompt (same prefix as other turns)
        tool_choice=choice,
        forced_tool=forced,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        output_format=out_format,
        output_schema=fmt.json_schema if fmt else None,
        thinking=False if effort in ("none", "minimal") else None,
    )


@post("/v1/responses", status_code=200, operation_class=body_operation(ResponsesRequest))
async def responses(request: Request[Any, Any, Any]) -> Response[Any]:
    started = time.monotonic()
    state = server_state(request)
    state.check_intake()
    body = await decode_body(request, ResponsesRequest)
    svc = state.service
    svc.check_model(body.model)
    req = to_chat_request(body)
    gen, _ = await svc.start_chat(req)
    out = ResponsesOutput(gen, svc.name, body)

    return await respond(request, "responses", gen, out, started, body.stream, ping=out.ping)
