"""The daemon's Anthropic Messages API, driven by the anthropic SDK against the real daemon."""

# ruff: noqa: F811  (pytest fixtures imported by name are redefined as parameters)

from __future__ import annotations

import anthropic
import pytest
from server_support.fixtures import anthropic_client, daemon  # noqa: F401

WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
}
HELLO = [{"role": "user", "content": "Hello"}]


def test_message_non_stream(anthropic_client, daemon):
    m = anthropic_client.messages.create(
        model=daemon.model, max_tokens=6, messages=HELLO, extra_body={"temperature": 0}
    )
    assert m.role == "assistant" and m.type == "message"
    assert m.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert 1 <= m.usage.output_tokens <= 6
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 3
    assert m.content


def test_stream_event_sequence_carries_usage(anthropic_client, daemon):
    """message_start (with usage) -> blocks -> message_delta (usage) -> message_stop."""
    events = []
    with anthropic_client.messages.stream(
        model=daemon.model,
        max_tokens=8,
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3;"},
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=HELLO,
        extra_body={"temperature": 0},
    ) as stream:
        for ev in stream:
            events.append(ev)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert events[0].message.usage.input_tokens > 0
    assert "message_delta" in kinds
    starts = kinds.count("content_block_start")
    assert starts >= 1 and starts == kinds.count("content_block_stop")
    assert final.usage.output_tokens >= 1
    assert final.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_beta_query_mid_conversation_system_and_unknown_fields(anthropic_client, daemon):
    """What Claude Code sends: ?beta=true, a system message mid-conversation, thinking config,
    context_management and other unknown fields."""
    m = anthropic_client.beta.messages.create(
        model=daemon.model,
        max_tokens=4,
        messages=[
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "x"},
                    {"type": "text", "text": "Hello"},
                ],
            },
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Again", "cache_control": {"type": "ephemeral"}}
                ],
            },
        ],
        thinking={"type": "enabled", "budget_tokens": 1024},
        metadata={"user_id": "u1"},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "high"}},
    )
    assert m.usage.output_tokens >= 1


def test_forced_tool_use_round_trip(anthropic_client, daemon):
    m = anthropic_client.messages.create(
        model=daemon.model,
        max_tokens=300,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        extra_body={"temperature": 0.7},
    )
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert set(use.input) == {"city", "days"} and 1 <= use.input["days"] <= 7
    assert isinstance(use.input["city"], str) and len(use.input["city"]) <= 6
    follow = anthropic_client.messages.create(
        model=daemon.model,
        max_tokens=5,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use.id,
                        "content": "sunny",
                        "is_error": False,
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
    )
    assert (
        follow.usage.input_tokens + (follow.usage.cache_read_input_tokens or 0)
        > m.usage.input_tokens
    )


def test_forced_tool_use_streams_input_json(anthropic_client, daemon):
    with anthropic_client.messages.stream(
        model=daemon.model,
        max_tokens=300,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather?"}],
    ) as stream:
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert set(use.input) == {"city", "days"}
    assert final.stop_reason == "tool_use"


def test_stop_sequences(anthropic_client, daemon):
    base = anthropic_client.messages.create(
        model=daemon.model, max_tokens=12, messages=HELLO, extra_body={"temperature": 0}
    )
    text = "".join(b.text for b in base.content if b.type == "text").strip()
    if len(text) < 3:
        pytest.skip("the random model produced too little text")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    m = anthropic_client.messages.create(
        model=daemon.model,
        max_tokens=12,
        messages=HELLO,
        extra_body={"temperature": 0},
        stop_sequences=[stop],
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_count_tokens(anthropic_client, daemon):
    small = anthropic_client.messages.count_tokens(model=daemon.model, messages=HELLO)
    big = anthropic_client.messages.count_tokens(
        model=daemon.model, messages=HELLO, tools=[WEATHER], system="Be nice."
    )
    assert 0 < small.input_tokens < big.input_tokens
    m = anthropic_client.messages.create(model=daemon.model, max_tokens=1, messages=HELLO)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == small.input_tokens


def test_errors_use_the_anthropic_shape(anthropic_client, daemon):
    # a model name the daemon does not have is answered by its model (strict_model_names off)
    m = anthropic_client.messages.create(model="claude-nope", max_tokens=2, messages=HELLO)
    assert m.model == daemon.model
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(
            model=daemon.model, max_tokens=2, messages=[{"role": "robot", "content": "x"}]
        )
    assert "role" in e.value.body["error"]["message"]
