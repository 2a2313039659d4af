"""The hostile corpus (issue 15): bodies built to hurt the daemon, for every endpoint. Each gets
an answer below 500 in its API's error shape, the daemon stays up, and a well-formed greedy
request decoding at the same time produces exactly the tokens it produces alone."""

# ruff: noqa: F811  (pytest fixtures imported by name are redefined as parameters)

from __future__ import annotations

import threading

import pytest
from server_support.fixtures import daemon  # noqa: F401
from server_support.greedy import GreedyProbe

HELLO = [{"role": "user", "content": "Hello"}]
DEPTH = 1500  # past Python's default recursion limit (1000)
INT64_OVER = 9223372036854775808  # 2**63: one past int64


def deep_list(n: int = DEPTH) -> str:
    return "[" * n + "]" * n


def deep_obj(n: int = DEPTH) -> str:
    return '{"a":' * n + "1" + "}" * n


def raw(template: str, model: str, inner: str) -> bytes:
    return template.replace("MODEL", model).replace("INNER", inner).encode()


def chat(m: str, **over) -> dict:
    return {"model": m, "messages": HELLO, "max_tokens": 2, **over}


def tools(n: int, params: dict | None = None) -> list[dict]:
    fn = {"name": "t", "parameters": params or {"type": "object"}}
    return [{"type": "function", "function": {**fn, "name": f"t{i}"}} for i in range(n)]


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


# (path, body builder) -> the answer must be 2xx or 4xx (never 5xx)
CORPUS = [
    # sampling fields out of every range
    (
        "/v1/completions",
        lambda m: {
            "model": m,
            "prompt": "hi",
            "temperature": 1,
            "max_tokens": 3,
            "top_k": INT64_OVER,
        },
    ),
    ("/v1/completions", lambda m: {"model": m, "prompt": "hi", "top_k": -INT64_OVER}),
    ("/v1/completions", lambda m: {"model": m, "prompt": "hi", "seed": 2**70}),
    ("/v1/completions", lambda m: {"model": m, "prompt": "hi", "max_tokens": INT64_OVER}),
    ("/v1/completions", lambda m: {"model": m, "prompt": "hi", "logprobs": INT64_OVER}),
    ("/v1/completions", lambda m: {"model": m, "prompt": "hi", "stop_token_ids": [INT64_OVER]}),
    (
        "/v1/completions",
        lambda m: {"model": m, "prompt": "hi", "stop_token_ids": list(range(5000))},
    ),
    ("/v1/completions", lambda m: {"model": m, "prompt": "hi", "temperature": 1e308}),
    ("/v1/completions", lambda m: {"model": m, "prompt": [INT64_OVER]}),
    ("/v1/completions", lambda m: {"model": m, "prompt": [1] * 300_000}),
    ("/v1/completions", lambda m: {"model": m, "prompt": "a " * 3_000_000}),
    ("/v1/completions", lambda m: {"model": m, "prompt": "hi", "stop": ["x" * 100_000]}),
    ("/v1/completions", lambda m: raw('{"model": "MODEL", "prompt": INNER}', m, deep_list())),
    ("/v1/chat/completions", lambda m: chat(m, top_logprobs=INT64_OVER, logprobs=True)),
    ("/v1/chat/completions", lambda m: chat(m, top_k=INT64_OVER, temperature=1)),
    ("/v1/chat/completions", lambda m: chat(m, max_completion_tokens=INT64_OVER)),
    ("/v1/chat/completions", lambda m: chat(m, messages=HELLO * 20_000)),
    ("/v1/chat/completions", lambda m: chat(m, tools=tools(2000))),
    ("/v1/chat/completions", lambda m: chat(m, tools=tools(1, nested_schema(200)))),
    (
        "/v1/chat/completions",
        lambda m: chat(m, tools=tools(1, nested_schema(200)), tool_choice="required"),
    ),
    (
        "/v1/chat/completions",
        lambda m: chat(
            m,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": nested_schema(300)},
            },
        ),
    ),
    (
        "/v1/chat/completions",
        lambda m: raw(
            '{"model": "MODEL", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],'
            ' "tools": [{"type": "function", "function": {"name": "f", "parameters": INNER}}]}',
            m,
            deep_obj(),
        ),
    ),
    (
        "/v1/chat/completions",
        lambda m: raw(
            '{"model": "MODEL", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],'
            ' "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type":'
            ' "object", "properties": {"a": INNER}}}}]}',
            m,
            deep_obj(900),
        ),
    ),
    (
        "/v1/chat/completions",
        lambda m: chat(
            m,
            messages=[
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": deep_obj()},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
            ],
        ),
    ),
    (
        "/v1/chat/completions",
        lambda m: raw(
            '{"model": "MODEL", "max_tokens": 2, "messages": [{"role": "user", "content": "x"},'
            ' {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": INNER}}]}]}',
            m,
            deep_obj(900),
        ),
    ),
    (
        "/v1/chat/completions",
        lambda m: raw('{"model": "MODEL", "messages": INNER}', m, deep_list()),
    ),
    ("/v1/chat/completions", lambda m: chat(m, chat_template_kwargs={"x": [[[[[[[[1]]]]]]]]})),
    (
        "/v1/chat/completions",
        lambda m: raw(
            '{"model": "MODEL", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],'
            ' "chat_template_kwargs": {"a": INNER}}',
            m,
            deep_obj(900),
        ),
    ),
    (
        "/v1/responses",
        lambda m: {
            "model": m,
            "input": "x",
            "top_k": INT64_OVER,
            "temperature": 1,
            "max_output_tokens": 2,
        },
    ),
    ("/v1/responses", lambda m: {"model": m, "input": "x", "seed": -(2**70)}),
    (
        "/v1/responses",
        lambda m: raw(
            '{"model": "MODEL", "input": "x", "tools": [{"type": "function", "name": "f",'
            ' "parameters": INNER}]}',
            m,
            deep_obj(900),
        ),
    ),
    (
        "/v1/responses",
        lambda m: raw(
            '{"model": "MODEL", "input": "x", "tools": INNER}',
            m,
            '[{"type": "namespace", "tools": ' * DEPTH + "[]" + "}]" * DEPTH,
        ),
    ),
    (
        "/v1/responses",
        lambda m: {
            "model": m,
            "input": [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": deep_obj()},
                {"type": "function_call_output", "call_id": "c", "output": "ok"},
            ],
            "max_output_tokens": 2,
        },
    ),
    (
        "/v1/messages",
        lambda m: {
            "model": m,
            "max_tokens": 2,
            "messages": HELLO,
            "top_k": INT64_OVER,
            "temperature": 1,
        },
    ),
    (
        "/v1/messages",
        lambda m: raw(
            '{"model": "MODEL", "max_tokens": 2, "messages": [{"role": "user", "content": "x"},'
            ' {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",'
            ' "input": {"a": INNER}}]}]}',
            m,
            deep_obj(900),
        ),
    ),
    (
        "/v1/messages",
        lambda m: raw(
            '{"model": "MODEL", "max_tokens": 2, "messages": [{"role": "user", "content": INNER}]}',
            m,
            '[{"type": "tool_result", "tool_use_id": "t", "content": ' * DEPTH
            + "[]"
            + "}]" * DEPTH,
        ),
    ),
    (
        "/v1/messages",
        lambda m: raw(
            '{"model": "MODEL", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],'
            ' "tools": [{"name": "f", "input_schema": INNER}]}',
            m,
            deep_obj(900),
        ),
    ),
    ("/v1/messages", lambda m: {"model": m, "max_tokens": 2, "messages": HELLO * 20_000}),
    (
        "/v1/messages",
        lambda m: {
            "model": m,
            "max_tokens": 2,
            "messages": HELLO,
            "tools": [{"name": f"t{i}"} for i in range(2000)],
        },
    ),
    (
        "/v1/messages",
        lambda m: {"model": m, "max_tokens": 2, "messages": HELLO, "stop_sequences": ["s"] * 1000},
    ),
    (
        "/v1/messages/count_tokens",
        lambda m: raw(
            '{"model": "MODEL", "messages": [{"role": "user", "content": "x"}],'
            ' "tools": [{"name": "f", "input_schema": INNER}]}',
            m,
            deep_obj(900),
        ),
    ),
    (
        "/v1/messages/count_tokens",
        lambda m: raw('{"model": "MODEL", "messages": INNER}', m, deep_list()),
    ),
    ("/v1/messages/count_tokens", lambda m: {"model": m, "messages": HELLO * 20_000}),
]


@pytest.fixture(scope="module")
def probe(daemon) -> GreedyProbe:
    """A greedy request decoding beside each hostile body (server_support/greedy.py)."""
    return GreedyProbe(daemon)


def _check(daemon, path: str, body) -> None:
    status, answer = daemon.post(path, body(daemon.model))
    assert status < 500, (path, status, answer)
    if status >= 400:  # in the API's own error shape, with a message
        if path.startswith("/v1/messages"):
            assert answer["type"] == "error" and answer["error"]["message"], answer
        else:
            assert answer["error"]["message"] and answer["error"]["type"], answer


@pytest.mark.parametrize(
    ("path", "body"), CORPUS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CORPUS)]
)
def test_hostile_body_gets_no_5xx(daemon, probe, path, body):
    result: list[str] = []
    beside = threading.Thread(target=lambda: result.append(probe.text()))
    beside.start()
    try:
        _check(daemon, path, body)
    finally:
        beside.join()
    assert result == [probe.alone], "a well-formed request beside the hostile one changed"
    assert daemon.proc.poll() is None


def test_top_k_overflow_does_not_fail_the_batch(daemon, probe):
    """The reported case: a sampled request with top_k 2**63 beside a greedy one; both
    answer, the greedy one with its own tokens."""
    hostile = {
        "model": daemon.model,
        "prompt": [5, 6],
        "temperature": 1,
        "max_tokens": 40,
        "top_k": INT64_OVER,
        "ignore_eos": True,
    }
    results: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda: results.__setitem__("g", probe.text())),
        threading.Thread(
            target=lambda: results.__setitem__("h", daemon.post("/v1/completions", hostile))
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["g"] == probe.alone
    status, body = results["h"]  # type: ignore[misc]
    assert status == 200 and body["usage"]["completion_tokens"] == 40, body


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**70}, "seed"),
        ({"stop_token_ids": list(range(100))}, "stop_token_ids"),
        ({"stop_token_ids": [10**12]}, "stop_token_ids"),
        ({"stop": ["x" * 5000]}, "stop"),
        ({"messages": HELLO * 10_001}, "messages"),
        ({"tools": tools(300)}, "tools"),
        ({"tools": tools(1, nested_schema(100))}, "deep"),
    ],
)
def test_field_limits_are_400_naming_the_field(daemon, over, needle):
    status, body = daemon.post("/v1/chat/completions", chat(daemon.model, **over))
    assert status == 400, body
    assert needle in body["error"]["message"], body


def test_deep_json_is_400_in_each_api_shape(daemon):
    status, body = daemon.post("/v1/chat/completions", raw('{"a": INNER}', "", deep_list()))
    assert status == 400 and "deep" in body["error"]["message"], body
    status, body = daemon.post("/v1/messages", raw('{"a": INNER}', "", deep_list()))
    assert status == 400 and body["type"] == "error" and "deep" in body["error"]["message"]


def test_prompt_size_is_checked_before_tokenizing(daemon):
    m = daemon.model
    status, body = daemon.post("/v1/completions", {"model": m, "prompt": [1] * 300_000})
    assert status == 400 and "more than the context" in body["error"]["message"], body
    status, body = daemon.post("/v1/completions", {"model": m, "prompt": "ab" * 4_000_000})
    assert status == 400 and "characters" in body["error"]["message"], body


def test_health_answers_while_a_large_prompt_is_tokenized(daemon):
    """Tokenizing a prompt of megabytes runs off the event loop: /health (and every other
    request) answers at once meanwhile. 2 MB is the most the default daemon tokenizes (the
    context, 131072 tokens, times the longest token's 16 characters; more is refused before
    tokenizing); it takes seconds, then the request is a 400 for its token count."""
    import random
    import time
    import urllib.request

    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "tool_call", '{"k":', "12345", "\n"]
    text = " ".join(rng.choice(words) for _ in range(400_000))[:2_000_000]
    done: dict[str, object] = {}

    def big() -> None:
        body = {"model": daemon.model, "prompt": text, "max_tokens": 1}
        done["answer"] = daemon.post("/v1/completions", body, timeout=300)
        done["at"] = time.monotonic()

    worker = threading.Thread(target=big)
    sent = time.monotonic()
    worker.start()
    polls: list[tuple[float, float]] = []  # (sent at, seconds to answer)
    while worker.is_alive():
        t0 = time.monotonic()
        with urllib.request.urlopen(daemon.url + "/health", timeout=60) as r:
            assert r.status == 200
        polls.append((t0, time.monotonic() - t0))
        time.sleep(0.05)
    worker.join()
    status, body = done["answer"]
    assert status == 400 and "the prompt has" in body["error"]["message"], body  # tokenized
    finished = float(done["at"])  # type: ignore[arg-type]
    took = finished - sent
    during = [dt for at, dt in polls if sent + 0.2 < at and at + dt < finished]
    assert took > 1.0 and len(during) >= 3, (took, len(during))  # the polls overlapped it
    # with the loop held, one poll waits about as long as the tokenizing (seconds); a loaded
    # test machine may delay a poll by a fraction of that
    slowest = max(dt for _, dt in polls)
    assert slowest < max(1.0, took / 4), (took, sorted(dt for _, dt in polls)[-3:])
