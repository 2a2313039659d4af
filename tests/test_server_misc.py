"""Root, health and Prometheus metrics endpoints."""

# ruff: noqa: F811  (pytest fixtures imported by name are redefined as parameters)

from __future__ import annotations

import urllib.request

from server_support.fixtures import daemon  # noqa: F401


def test_head_and_get_root(daemon):
    req = urllib.request.Request(daemon.url + "/?beta=true", method="HEAD")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and r.read() == b""
    status, body = daemon.get("/")
    assert status == 200 and b"freetokend" in body


def test_health(daemon):
    status, body = daemon.get("/health")
    assert status == 200 and b'"ok"' in body


def test_metrics_exposition(daemon):
    daemon.post(
        "/v1/chat/completions",
        {"model": daemon.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    status, raw = daemon.get("/metrics")
    assert status == 200
    text = raw.decode()
    for name in (
        "freetoken_generation_tokens_per_second",
        "freetoken_time_to_first_token_seconds_bucket",
        "freetoken_queue_depth",
        "freetoken_expert_cache_hit_ratio",
        "freetoken_kv_pages_used",
        "freetoken_kv_usage_ratio",
    ):
        assert f"# TYPE {name.removesuffix('_bucket')}" in text, name
    m = daemon.metrics()
    assert m["freetoken_generation_tokens_total"] >= 3
    assert m["freetoken_time_to_first_token_seconds_count"] >= 1
    assert m["freetoken_kv_pages_total"] > 0
    assert 'freetoken_requests_total{api="chat",status="200"}' in text


def test_cached_prompt_tokens_are_reported(daemon):
    """The engine's prefix cache shows in each API's usage; Claude Code's per-prompt billing
    line is dropped from the system prompt, so it does not defeat the cache."""
    system = "You are a careful assistant. " * 12
    chat = {
        "model": daemon.model,
        "max_tokens": 1,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
    }
    daemon.post("/v1/chat/completions", chat)
    _, body = daemon.post("/v1/chat/completions", chat)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 100

    def anthropic(billing: str) -> dict:
        blocks = [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version={billing};"},
            {"type": "text", "text": system + "(claude)", "cache_control": {"type": "ephemeral"}},
        ]
        _, out = daemon.post(
            "/v1/messages?beta=true",
            {
                "model": daemon.model,
                "max_tokens": 1,
                "system": blocks,
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )
        return out["usage"]

    first = anthropic("1.0.1.abc")
    second = anthropic("1.0.1.def")  # another prompt's billing suffix
    assert second["cache_read_input_tokens"] > 100
    total = second["input_tokens"] + second["cache_read_input_tokens"]
    assert total == first["input_tokens"] + first["cache_read_input_tokens"]


def test_sigusr1_writes_every_thread_stack_and_keeps_serving(daemon):
    """`kill -USR1`: what a hung daemon is doing (faulthandler), without stopping it."""
    import signal
    import time

    before = len(daemon.log)
    daemon.proc.send_signal(signal.SIGUSR1)
    # the dump reaches daemon.log line by line (a reader thread): wait for all of it that the
    # asserts below read, not for its first lines
    deadline = time.monotonic() + 60
    while True:
        dump = "".join(daemon.log[before:])
        threads = "Current thread" in dump or "Thread 0x" in dump
        if (threads and "bridge.py" in dump) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert threads, dump[-2000:]
    assert "bridge.py" in dump, dump[-2000:]  # the engine thread's loop is in it
    assert daemon.get("/health")[0] == 200
