"""Whatever a client sends, the daemon answers 4xx with a message in the API's own error
shape (never a 500), and keeps serving."""

# ruff: noqa: F811  (pytest fixtures imported by name are redefined as parameters)

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

import pytest
from server_support.fixtures import daemon  # noqa: F401

HELLO = [{"role": "user", "content": "Hello"}]


def chat(model: str, **over):
    return {"model": model, "messages": HELLO, "max_tokens": 2, **over}


def anth(model: str, **over):
    return {"model": model, "messages": HELLO, "max_tokens": 2, **over}


WEATHER_TOOL = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}

# (path, body builder, expected status, text the message must contain)
CASES = [
    ("/v1/chat/completions", lambda m: b'{"model": "x", "messages": [', 400, "JSON"),
    ("/v1/chat/completions", lambda m: b"", 400, "empty"),
    ("/v1/chat/completions", lambda m: b"[1, 2]", 400, "object"),
    ("/v1/chat/completions", lambda m: b'{"model": "\xff\xfe", "messages": []}', 400, "utf-8"),
    ("/v1/chat/completions", lambda m: chat(m, max_tokens="ten"), 400, "max_tokens"),
    ("/v1/chat/completions", lambda m: chat(m, temperature=[1]), 400, "temperature"),
    ("/v1/chat/completions", lambda m: {"model": m, "max_tokens": 2}, 400, "messages"),
    ("/v1/chat/completions", lambda m: {"messages": HELLO}, 400, "model"),
    ("/v1/chat/completions", lambda m: chat(m, max_tokens=-5), 400, "max_tokens"),
    ("/v1/chat/completions", lambda m: chat(m, max_tokens=10**12), 400, "max_tokens"),
    ("/v1/chat/completions", lambda m: chat(m, max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", lambda m: chat(m, temperature=-1), 400, "temperature"),
    ("/v1/chat/completions", lambda m: chat(m, top_p=0), 400, "top_p"),
    ("/v1/chat/completions", lambda m: chat(m, messages=[]), 400, "messages"),
    (
        "/v1/chat/completions",
        lambda m: chat(m, messages=[{"role": "wizard", "content": "x"}]),
        400,
        "role",
    ),
    ("/v1/chat/completions", lambda m: chat(m, messages=[{"content": "x"}]), 400, "role"),
    (
        "/v1/chat/completions",
        lambda m: chat(m, messages=[{"role": "user", "content": 5}]),
        400,
        "content",
    ),
    ("/v1/chat/completions", lambda m: chat(m, tools=[{"type": "function"}]), 400, "function"),
    (
        "/v1/chat/completions",
        lambda m: chat(m, tools=[{"type": "function", "function": {"name": "a b"}}]),
        400,
        "name",
    ),
    (
        "/v1/chat/completions",
        lambda m: chat(
            m, tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]
        ),
        400,
        "parameters",
    ),
    (
        "/v1/chat/completions",
        lambda m: chat(
            m,
            tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ],
        ),
        400,
        "object",
    ),
    (
        "/v1/chat/completions",
        lambda m: chat(m, tools=[WEATHER_TOOL], tool_choice="sometimes"),
        400,
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        lambda m: chat(
            m, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "zz"}}
        ),
        400,
        "zz",
    ),
    (
        "/v1/chat/completions",
        lambda m: chat(
            m,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}},
                },
            },
        ),
        400,
        "schema",
    ),
    (
        "/v1/chat/completions",
        lambda m: chat(m, response_format={"type": "yaml"}),
        400,
        "response_format",
    ),
    ("/v1/chat/completions", lambda m: chat(m, stop=["a"] * 40), 400, "stop"),
    ("/v1/chat/completions", lambda m: chat(m, n=3), 400, "n"),
    ("/v1/completions", lambda m: {"model": m, "prompt": [], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", lambda m: {"model": m, "prompt": [10**9], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", lambda m: {"model": m, "prompt": {"a": 1}}, 400, "prompt"),
    ("/v1/responses", lambda m: {"model": m, "input": []}, 400, "input"),
    (
        "/v1/responses",
        lambda m: {"model": m, "input": [{"type": "function_call", "call_id": "c"}]},
        400,
        "name",
    ),
    (
        "/v1/responses",
        lambda m: {"model": m, "input": "x", "max_output_tokens": -1},
        400,
        "max_output_tokens",
    ),
    ("/v1/messages", lambda m: {"model": m, "messages": HELLO}, 400, "max_tokens"),
    ("/v1/messages", lambda m: anth(m, messages=[{"role": "bot", "content": "x"}]), 400, "role"),
    ("/v1/messages", lambda m: anth(m, messages=[]), 400, "messages"),
    ("/v1/messages", lambda m: anth(m, max_tokens=-1), 400, "max_tokens"),
    ("/v1/messages", lambda m: anth(m, tools=[{"name": "", "input_schema": {}}]), 400, "name"),
    ("/v1/messages", lambda m: anth(m, system=7), 400, "system"),
    ("/v1/messages", lambda m: b"{not json", 400, "JSON"),
    ("/v1/messages/count_tokens", lambda m: {"model": m}, 400, "messages"),
    ("/v1/nothing", lambda m: {}, 404, "/v1/nothing"),
]


@pytest.mark.parametrize(
    ("path", "build", "status", "needle"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_bad_request_gets_4xx_with_a_message(daemon, path, build, status, needle):
    got, body = daemon.post(path, build(daemon.model))
    assert got == status, body
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
        message = body["error"]["message"]
    else:
        message = body["error"]["message"]
        assert body["error"]["type"]
    assert needle.lower() in message.lower(), message


def test_wrong_method_and_huge_body(daemon):
    status, _ = daemon.get("/v1/chat/completions")
    assert status == 405
    # 50 MB: refused with 413 (from the announced length, before it is all read)
    u = urlparse(daemon.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    size = 50 * 1024 * 1024
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("content-type", "application/json")
    conn.putheader("content-length", str(size))
    conn.endheaders()
    try:
        conn.send(b'{"model": "' + b"a" * (size - 20) + b'"}')
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may answer and close before the body is all sent
    resp = conn.getresponse()
    assert resp.status == 413
    assert "larger" in json.loads(resp.read())["error"]["message"]
    conn.close()


def test_still_serving_after_the_abuse(daemon):
    status, body = daemon.post("/v1/chat/completions", chat(daemon.model))
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    assert daemon.get("/health")[0] == 200
    # none left behind: the shared daemon may still be finishing an earlier test's aborted
    # stream, so wait (60 s at most) rather than read once
    deadline = time.monotonic() + 60
    while (m := daemon.metrics())["freetoken_requests_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m["freetoken_requests_in_flight"] == 0
