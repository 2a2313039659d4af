"""The daemon's Responses API (what Codex speaks), driven by the openai SDK."""

# ruff: noqa: F811  (pytest fixtures imported by name are redefined as parameters)

from __future__ import annotations

import json

from server_support.fixtures import daemon, openai_client  # noqa: F401

SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Run a command",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "command": {
                "type": "array",
                "items": {"type": "string", "maxLength": 5},
                "maxItems": 2,
            }
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}
# Tool kinds Codex sends that we cannot run: accepted and dropped, never a 400.
NAMESPACE = {
    "type": "namespace",
    "name": "mcp",
    "description": "x",
    "tools": [dict(SHELL, name="inner")],
}
WEB = {"type": "web_search", "external_web_access": False}
CODEX_EXTRAS = {
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "abc",
    "client_metadata": {"x": 1},
    "reasoning": {"summary": "auto"},
}


def test_stream_event_order_and_completed_usage(openai_client, daemon):
    stream = openai_client.responses.create(
        model=daemon.model,
        input=[
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Be terse."}],
            },
            {"role": "system", "content": "Also kind."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hello"}],
            },
        ],
        instructions="You are a test.",
        max_output_tokens=8,
        stream=True,
        tools=[SHELL, NAMESPACE, WEB],
        tool_choice="none",
        parallel_tool_calls=True,
        extra_body=CODEX_EXTRAS,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    done = events[-1].response
    assert done.usage.output_tokens >= 1 and done.usage.input_tokens > 0
    assert done.usage.input_tokens_details.cached_tokens >= 0
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert done.output_text == text
    # every item that was added is done, in order
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    finished = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert added == finished == [item.id for item in done.output]


def test_non_stream(openai_client, daemon):
    r = openai_client.responses.create(model=daemon.model, input="Hello", max_output_tokens=5)
    assert r.status in ("completed", "incomplete")
    assert r.usage.output_tokens <= 5
    assert r.output and r.output[-1].type in ("message", "function_call")


def test_function_call_round_trip(openai_client, daemon):
    """A forced call, echoed back verbatim with its output, as Codex does."""
    first = openai_client.responses.create(
        model=daemon.model,
        input=[{"role": "user", "content": "list files"}],
        tools=[SHELL, NAMESPACE, WEB],
        tool_choice={"type": "function", "name": "shell"},
        max_output_tokens=300,
        stream=True,
        extra_body=CODEX_EXTRAS,
    )
    events = list(first)
    assert events[-1].type == "response.completed"
    calls = [i for i in events[-1].response.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "shell"
    args = json.loads(calls[0].arguments)
    assert isinstance(args["command"], list) and all(isinstance(c, str) for c in args["command"])
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == calls[0].arguments
    history = [
        {"role": "user", "content": "list files"},
        calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "a.txt\nb.txt"},
    ]
    second = openai_client.responses.create(
        model=daemon.model, input=history, tools=[SHELL], max_output_tokens=4
    )
    # the call and its output are in the prompt now
    assert second.usage.input_tokens > events[-1].response.usage.input_tokens
    assert second.status in ("completed", "incomplete")


def test_previous_response_id_is_refused_with_a_reason(daemon):
    status, body = daemon.post(
        "/v1/responses", {"model": daemon.model, "input": "x", "previous_response_id": "resp_1"}
    )
    assert status == 400 and body["error"]["param"] == "previous_response_id"
