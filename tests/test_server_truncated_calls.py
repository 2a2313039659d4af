"""A tool call cut by the token limit is still a tool call (partial arguments, finish_reason
"length" / stop_reason "max_tokens" / status "incomplete"), never markup in the text: in each
tool syntax, and end to end in every API, streamed and not (issue 15, item 2)."""

# ruff: noqa: F811  (pytest fixtures imported by name are redefined as parameters)

from __future__ import annotations

import json

import pytest
from server_support.fixtures import daemon  # noqa: F401

from freetokend.server.parsers.base import Content, ToolCall, arguments_object
from freetokend.server.parsers.registry import (
    OutputSyntax,
    ReasoningSyntax,
    ToolSyntax,
    make_output_parser,
)

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
XML = OutputSyntax(ToolSyntax.QWEN3_XML, ReasoningSyntax.THINK)
JSON_ = OutputSyntax(ToolSyntax.QWEN3_JSON, ReasoningSyntax.THINK)
HARMONY = OutputSyntax(ToolSyntax.HARMONY, ReasoningSyntax.HARMONY)
MARKUP = ("<tool", "<function", "<parameter", "</", "<|channel|>", '"arguments"')

CUTS = [
    (XML, "<tool_ca", "get_weather", {}),
    (XML, "<tool_call>\n", "get_weather", {}),
    (XML, "<tool_call>\n<function=get_wea", "get_weather", {}),
    (XML, "<tool_call>\n<function=get_weather>\n<parameter=ci", "get_weather", {}),
    (
        XML,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "get_weather",
        {"city": "Par"},
    ),
    (
        XML,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</param",
        "get_weather",
        {"city": "Paris"},
    ),
    (JSON_, '<tool_call>\n{"name": "get_w', "get_weather", {}),
    (
        JSON_,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
        "get_weather",
        {"city": "Pa"},
    ),
    (HARMONY, "<|channel|>commentary to=functions.get_wea", "get_weather", {}),
    (
        HARMONY,
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"ci',
        "get_weather",
        {},
    ),
]


@pytest.mark.parametrize(("syntax", "text", "name", "args"), CUTS)
def test_a_cut_call_is_a_partial_call_not_text(syntax, text, name, args):
    parser = make_output_parser(syntax, TOOLS, start_in_reasoning=False)
    events = parser.feed(text) + parser.finish(truncated=True)
    calls = [e for e in events if isinstance(e, ToolCall)]
    text_out = "".join(e.text for e in events if isinstance(e, Content))
    assert not any(m in text_out for m in MARKUP), text_out
    assert len(calls) == 1 and calls[0].name == name and calls[0].partial
    assert arguments_object(calls[0].arguments) == args


def test_a_stop_inside_a_call_still_gives_the_text_back():
    parser = make_output_parser(XML, TOOLS)
    events = parser.feed("<tool_call>\n<function=get_wea") + parser.finish()
    assert not any(isinstance(e, ToolCall) for e in events)


def test_arguments_object_closes_what_it_can():
    assert arguments_object('{"a": 1, "b": [1, 2') == {"a": 1, "b": [1, 2]}
    assert arguments_object('{"a": 1, "b') == {"a": 1}
    assert arguments_object('{"a": {"b": "x') == {"a": {"b": "x"}}
    assert arguments_object("nonsense") == {}


GLM = OutputSyntax(ToolSyntax.GLM_XML, ReasoningSyntax.THINK)
MINIMAX = OutputSyntax(ToolSyntax.MINIMAX_XML, ReasoningSyntax.THINK)
GEMMA = OutputSyntax(ToolSyntax.GEMMA4, ReasoningSyntax.GEMMA4_THOUGHT)
TWO_TOOLS = {**TOOLS, "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}}}
# a whole call of each syntax (the arguments below), its opening and closing tags
WHOLE = {
    "glm45": (
        GLM,
        "<tool_call>",
        "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>12</arg_value>\n",
        "</tool_call>",
    ),  # fmt: skip
    "glm47": (
        GLM,
        "<tool_call>",
        "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>12</arg_value>",
        "</tool_call>",
    ),  # fmt: skip
    "minimax": (
        MINIMAX,
        "<minimax:tool_call>",
        '\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n<parameter name="days">12</parameter>\n</invoke>\n',
        "</minimax:tool_call>",
    ),  # fmt: skip
    "gemma4": (
        GEMMA,
        "<|tool_call>",
        'call:get_weather{city:<|"|>Paris<|"|>,days:12,opts:{units:[<|"|>c<|"|>,<|"|>k<|"|>]}}',
        "<tool_call|>",
    ),  # fmt: skip
}
WHOLE_ARGS = {"city": "Paris", "days": 12, "opts": {"units": ["c", "k"]}}
MARKUP_MORE = (*MARKUP, "<arg_", "<invoke", "<minimax", "call:", "<|tool_call>", '<|"|>')


def _is_prefix_of(part: object, whole: object) -> bool:
    """``part`` is what a cut text of ``whole`` may decode to: strings and numbers cut short,
    containers with their members so far (the last one cut)."""
    if isinstance(whole, dict):
        return isinstance(part, dict) and all(
            k in whole and _is_prefix_of(v, whole[k]) for k, v in part.items()
        )
    if isinstance(whole, list):
        return (
            isinstance(part, list)
            and len(part) <= len(whole)
            and all(_is_prefix_of(*p) for p in zip(part, whole, strict=False))
        )
    return part == whole or str(whole).startswith(str(part))


@pytest.mark.parametrize("case", list(WHOLE))
@pytest.mark.parametrize("tools", [TOOLS, TWO_TOOLS], ids=["one-tool", "two-tools"])
def test_every_cut_of_a_glm_minimax_gemma_call_is_a_partial_call(case, tools):
    """Issue 15 item 2 for the syntaxes of the new families: cut at every character after the
    opening tag, the answer is one partial call of the right tool with arguments that are a
    prefix of the whole ones, or (a name too short to tell two tools apart) nothing; never
    markup in the text. Uncut, the call decodes whole."""
    syntax, open_tag, body, close_tag = WHOLE[case]
    whole_args = {k: v for k, v in WHOLE_ARGS.items() if k in body}
    told = False
    for cut in range(len(open_tag), len(open_tag + body) + 1):
        parser = make_output_parser(syntax, tools, start_in_reasoning=False)
        events = parser.feed((open_tag + body)[:cut]) + parser.finish(truncated=True)
        text_out = "".join(e.text for e in events if isinstance(e, Content))
        assert not any(m in text_out for m in MARKUP_MORE), (cut, text_out)
        calls = [e for e in events if isinstance(e, ToolCall)]
        if not calls:
            assert len(tools) > 1 and not told, (cut, "a call that was told went missing")
            continue
        told = True
        [call] = calls
        assert call.name == "get_weather" and call.partial, (cut, call)
        assert _is_prefix_of(arguments_object(call.arguments), whole_args), (cut, call)
    assert told
    parser = make_output_parser(syntax, tools, start_in_reasoning=False)
    [call] = [e for e in parser.feed(open_tag + body + close_tag) + parser.finish() if isinstance(e, ToolCall)]  # fmt: skip
    assert not call.partial and json.loads(call.arguments) == whole_args


# --- end to end: a forced call with a budget too small to finish it -------------------------

# "city" required: the forced call must write a value, and the random model's value runs on
# (at temperature 0, the same way every run), so every budget below ends inside the call
PARAMS = {**TOOLS["get_weather"], "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}


def _sse(daemon, path: str, body: dict) -> list[dict]:
    """The data payloads of an SSE answer."""
    import urllib.request

    req = urllib.request.Request(
        daemon.url + path,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    out = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


@pytest.mark.parametrize("max_tokens", [5, 70])
def test_chat_completions_cut_call(daemon, max_tokens):
    body = {
        "model": daemon.model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "weather?"}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    status, answer = daemon.post("/v1/chat/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    assert not any(m in (choice["message"].get("content") or "") for m in MARKUP), choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    if max_tokens == 70:  # far enough to have begun the value: partial arguments
        assert "city" in arguments_object(call["function"]["arguments"])
    chunks = _sse(daemon, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    text = "".join(d.get("content") or "" for d in deltas)
    assert not any(m in text for m in MARKUP), text
    assert any(d.get("tool_calls") for d in deltas)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "length"


def test_anthropic_messages_cut_call(daemon):
    body = {
        "model": daemon.model,
        "max_tokens": 70,
        "temperature": 0,
        "messages": [{"role": "user", "content": "w"}],
        "tools": [{"name": "get_weather", "input_schema": PARAMS}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    status, answer = daemon.post("/v1/messages", body)
    assert status == 200, answer
    assert answer["stop_reason"] == "max_tokens"
    [use] = [b for b in answer["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather" and "city" in use["input"], answer
    assert not any(m in b.get("text", "") for b in answer["content"] for m in MARKUP), answer
    events = _sse(daemon, "/v1/messages", body)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert "tool_use" in starts
    partial = "".join(
        e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta"
    )
    assert isinstance(json.loads(partial), dict)  # what a client accumulates parses
    [delta] = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] == "max_tokens"


def test_responses_cut_call(daemon):
    body = {
        "model": daemon.model,
        "max_output_tokens": 70,
        "temperature": 0,
        "input": "weather?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    status, answer = daemon.post("/v1/responses", body)
    assert status == 200, answer
    assert answer["status"] == "incomplete"
    calls = [o for o in answer["output"] if o["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather", answer
    texts = [
        c.get("text", "") for o in answer["output"] if o["type"] == "message" for c in o["content"]
    ]
    assert not any(m in t for t in texts for m in MARKUP), answer
    events = _sse(daemon, "/v1/responses", body)
    done = [e for e in events if e.get("type") == "response.output_item.done"]
    assert any(e["item"]["type"] == "function_call" for e in done)
    assert events[-1]["response"]["status"] == "incomplete"


# --- issue 46 item 3: a named tool_choice is always a call of that function ------------------

# seed 41 put </tool_call> inside the city string on this machine before the fix (1 of 60
# seeds; the logits, and so the seed that does it, may differ with the CPU's kernels)
SAMPLED_SEEDS = [0, 1, 2, 3, 41]


def _streamed_calls(daemon, body: dict) -> tuple[str, list[dict], str]:
    """(content, the calls assembled from the deltas, finish_reason) of a streamed answer."""
    chunks = _sse(daemon, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc.get("function", {}).get("name") or ""
            call["arguments"] += tc.get("function", {}).get("arguments") or ""
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1]
    return "".join(d.get("content") or "" for d in deltas), list(calls.values()), finish


def test_a_sampled_named_call_is_always_that_call(daemon):
    """The built-in model at the default temperature (1), max_tokens 64, several seeds, streamed
    and not: always exactly one call of the named function whose arguments parse (whole, or so
    far when the limit cut it), never markup in the content. Before the fix a JSON string
    argument could hold </tool_call> (an added token of this tokenizer), and the parser closed
    the call there: raw markup in content in about 1 of 10 tries."""
    for seed in SAMPLED_SEEDS:
        body = {
            "model": daemon.model,
            "max_tokens": 64,
            "seed": seed,
            "tools": [WEATHER],
            "messages": [{"role": "user", "content": "weather?"}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
        status, answer = daemon.post("/v1/chat/completions", body)
        assert status == 200, answer
        choice = answer["choices"][0]
        content = choice["message"].get("content") or ""
        streamed = _streamed_calls(daemon, body)
        for text, calls, finish in (
            (content, [c["function"] for c in choice["message"].get("tool_calls") or []], choice["finish_reason"]),
            streamed,
        ):  # fmt: skip
            assert not text.strip(), (seed, text)
            assert [c["name"] for c in calls] == ["get_weather"], (seed, calls)
            args = calls[0]["arguments"]
            if finish == "length":
                assert isinstance(arguments_object(args), dict)
            else:
                assert finish == "tool_calls" and isinstance(json.loads(args), dict), (seed, args)
