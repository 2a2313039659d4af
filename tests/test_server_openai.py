"""The daemon's OpenAI Chat Completions / Completions / Models API, driven by the openai SDK
against the real daemon process serving the built-in tiny (random-weight) model."""

# ruff: noqa: F811  (pytest fixtures imported by name are redefined as parameters)

from __future__ import annotations

import json

import openai
import pytest
from server_support.fixtures import daemon, openai_client  # noqa: F401

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "days", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 5}},
            "required": ["zone"],
        },
    },
}
HELLO = [{"role": "user", "content": "Hello"}]


def check_weather_args(arguments: str) -> dict:
    """Arguments valid under WEATHER's schema."""
    args = json.loads(arguments)
    assert set(args) == {"city", "days", "unit"}
    assert isinstance(args["city"], str) and len(args["city"]) <= 6
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    assert args["unit"] in ("C", "F")
    return args


def test_models_lists_the_served_model(openai_client, daemon):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [daemon.model]
    assert openai_client.models.retrieve(daemon.model).id == daemon.model
    with pytest.raises(openai.NotFoundError, match="no-such-model.* does not exist"):
        openai_client.models.retrieve("no-such-model")


def test_chat_non_stream_reports_usage(openai_client, daemon):
    r = openai_client.chat.completions.create(
        model=daemon.model, messages=HELLO, max_tokens=6, temperature=0
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop", "tool_calls")
    assert r.usage.completion_tokens <= 6 and r.usage.completion_tokens >= 1
    assert r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_ends_with_usage_chunk(openai_client, daemon):
    stream = openai_client.chat.completions.create(
        model=daemon.model,
        messages=HELLO,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens > 0
    if finals[0].choices[0].finish_reason == "length":
        assert usage.completion_tokens == 6


def test_greedy_is_deterministic_and_stop_strings_cut(openai_client, daemon):
    kw = dict(model=daemon.model, messages=HELLO, max_tokens=12, temperature=0)
    full = openai_client.chat.completions.create(**kw).choices[0].message.content or ""
    again = openai_client.chat.completions.create(**kw).choices[0].message.content or ""
    assert full == again
    visible = full.strip()
    if len(visible) < 3:
        pytest.skip("the random model produced too little text to cut")
    stop = visible[len(visible) // 2 : len(visible) // 2 + 2]
    cut = openai_client.chat.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert stop not in (cut.message.content or "")
    assert full.startswith(cut.message.content or "")


def test_forced_tool_call_round_trip(openai_client, daemon):
    """Named tool_choice forces a call whose arguments satisfy the schema (even from random
    weights); the tool result then goes back and the model answers."""
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    r = openai_client.chat.completions.create(
        model=daemon.model,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=300,
        temperature=0.8,
        seed=7,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    check_weather_args(call.function.arguments)
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    answer = openai_client.chat.completions.create(
        model=daemon.model,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_tokens=8,
    )
    assert answer.choices[0].finish_reason in ("stop", "length")  # "none": never tool_calls
    assert not answer.choices[0].message.tool_calls
    # the history (call + result) is in the prompt: longer than the first turn's
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens


def test_required_tool_choice_streams_a_valid_call(openai_client, daemon):
    stream = openai_client.chat.completions.create(
        model=daemon.model,
        messages=[{"role": "user", "content": "time?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=300,
        stream=True,
        seed=3,
        temperature=1.0,
    )
    calls, reasons = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls"
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    args = json.loads(calls[0].function.arguments)
    if calls[0].function.name == "get_weather":
        check_weather_args(calls[0].function.arguments)
    else:
        assert set(args) == {"zone"} and isinstance(args["zone"], str)


def test_json_schema_response_format(openai_client, daemon):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
    }
    r = openai_client.chat.completions.create(
        model=daemon.model,
        messages=HELLO,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema},
        },
        max_tokens=200,
        seed=1,
    )
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_json_object_response_format(openai_client, daemon):
    r = openai_client.chat.completions.create(
        model=daemon.model,
        messages=HELLO,
        response_format={"type": "json_object"},
        max_tokens=40,
        seed=2,
    )
    content = r.choices[0].message.content or ""
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert content.lstrip().startswith("{")


def test_logprobs(openai_client, daemon):
    r = openai_client.chat.completions.create(
        model=daemon.model,
        messages=HELLO,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
    )
    entries = r.choices[0].logprobs.content
    assert 1 <= len(entries) <= 4
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)


def test_logprobs_name_tokens_by_id_when_asked(openai_client, daemon):
    """vLLM's return_tokens_as_token_ids: "token_id:<id>" names, so byte tokens (all U+FFFD as
    text) keep one top_logprobs entry each; the values and the text stay as without it."""
    body = {"model": daemon.model, "prompt": [40, 41, 42], "max_tokens": 8, "temperature": 0}
    body |= {"ignore_eos": True, "logprobs": 5}
    _, plain = daemon.post("/v1/completions", body)
    status, named = daemon.post("/v1/completions", {**body, "return_tokens_as_token_ids": True})
    assert status == 200, named
    a, b = plain["choices"][0], named["choices"][0]
    assert a["text"] == b["text"]
    lp = b["logprobs"]
    assert lp["token_logprobs"] == a["logprobs"]["token_logprobs"]
    assert lp["text_offset"] == a["logprobs"]["text_offset"]
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert tok.startswith("token_id:") and int(tok.removeprefix("token_id:")) >= 0
        assert len(top) == 5 and all(k.startswith("token_id:") for k in top)
        assert top[tok] == value == max(top.values())  # greedy: the chosen one leads
    stream = openai_client.completions.create(
        model=daemon.model,
        prompt=[40, 41, 42],
        max_tokens=8,
        temperature=0,
        logprobs=5,
        stream=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    streamed = [
        t
        for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert streamed == lp["tokens"]
    chat = {"model": daemon.model, "messages": HELLO, "max_tokens": 4, "temperature": 0}
    chat |= {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    status, c = daemon.post("/v1/chat/completions", chat)
    assert status == 200, c
    entries = c["choices"][0]["logprobs"]["content"]
    assert 1 <= len(entries) <= 4
    for e in entries:
        assert e["token"].startswith("token_id:")
        assert all(t["token"].startswith("token_id:") for t in e["top_logprobs"])


def test_completions_text_and_token_ids(openai_client, daemon):
    r = openai_client.completions.create(
        model=daemon.model, prompt="Hello the", max_tokens=5, temperature=0
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens >= 2
    ids = openai_client.completions.create(
        model=daemon.model, prompt=[40, 41, 42], max_tokens=3, temperature=0
    )
    assert ids.usage.prompt_tokens == 3
    streamed = "".join(
        c.choices[0].text
        for c in openai_client.completions.create(
            model=daemon.model, prompt="Hello the", max_tokens=5, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_errors_name_the_problem(openai_client, daemon):
    # a model name the daemon does not have is answered by its model (strict_model_names off)
    r = openai_client.chat.completions.create(model="nope", messages=HELLO, max_tokens=2)
    assert r.model == daemon.model
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=daemon.model, messages=HELLO, max_tokens=2, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=daemon.model, messages=HELLO, max_tokens=131070)
    text = str(e.value)
    assert "131072" in text and "131070" in text  # the context and the request's numbers
