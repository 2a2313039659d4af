"""Usage honesty: in every API, streaming or not, the cached prompt tokens a response reports are
exactly the prompt tokens the engine did not compute (its own counter, on /metrics), including
the Messages stream's ``message_start`` (Claude Code and OpenCode read input usage there)."""

# ruff: noqa: F811  (pytest fixtures imported by name are redefined as parameters)

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from server_support.fixtures import anthropic_client, daemon, openai_client  # noqa: F401

COMPUTED = "freetoken_engine_prompt_tokens_computed_total"
SYSTEM = "You are a careful coding agent. " + "Read the files before you edit them. " * 30


def computed(daemon) -> float:  # type: ignore[no-untyped-def]
    """The engine's count once its stats settled (no request running)."""
    deadline = time.monotonic() + 60
    while True:
        m = daemon.metrics()
        if m.get("freetoken_requests_running", 0) == 0 or time.monotonic() > deadline:
            return m[COMPUTED]
        time.sleep(0.05)


def settled_delta(daemon, before: float) -> float:  # type: ignore[no-untyped-def]
    """Prompt tokens computed since ``before`` (waits for the stats of the finished request)."""
    deadline = time.monotonic() + 60
    while (now := computed(daemon)) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return now - before


def chat(client, model: str, task: str, stream: bool) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    kw = dict(model=model, messages=msgs, max_tokens=3, temperature=0)
    if not stream:
        u = client.chat.completions.create(**kw).usage
    else:
        chunks = list(
            client.chat.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}
            )
        )
        u = chunks[-1].usage
    return u.prompt_tokens, u.prompt_tokens_details.cached_tokens


def completion(client, model: str, task: str, stream: bool) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    kw = dict(model=model, prompt=SYSTEM + task, max_tokens=3, temperature=0)
    if not stream:
        u = client.completions.create(**kw).usage
    else:
        chunks = list(
            client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        )
        u = chunks[-1].usage
    return u.prompt_tokens, u.prompt_tokens_details.cached_tokens


def responses(client, model: str, task: str, stream: bool) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    kw = dict(model=model, instructions=SYSTEM, input=task, max_output_tokens=3, temperature=0)
    if not stream:
        u = client.responses.create(**kw).usage
    else:
        events = list(client.responses.create(**kw, stream=True))
        u = next(e for e in events if e.type == "response.completed").response.usage
    return u.input_tokens, u.input_tokens_details.cached_tokens


def messages(client, model: str, task: str, stream: bool) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    kw = dict(
        model=model,
        system=SYSTEM,
        messages=[{"role": "user", "content": task}],
        max_tokens=3,
        extra_body={"temperature": 0},
    )
    if not stream:
        u = client.messages.create(**kw).usage
    else:
        with client.messages.stream(**kw) as s:
            events = list(s)
            u = s.get_final_message().usage
        start = next(e for e in events if e.type == "message_start").message.usage
        assert (start.input_tokens, start.cache_read_input_tokens) == (
            u.input_tokens,
            u.cache_read_input_tokens,
        ), "message_start must announce the cached prompt tokens"
    cached = u.cache_read_input_tokens or 0
    return u.input_tokens + cached, cached


API: dict[str, Callable] = {
    "chat": chat,
    "completions": completion,
    "responses": responses,
    "messages": messages,
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", list(API))
def test_cached_tokens_are_the_tokens_not_computed(
    api, stream, daemon, openai_client, anthropic_client
):
    client = anthropic_client if api == "messages" else openai_client
    task = f"Fix the failing test ({api}, {stream})."
    seen = []
    for _ in range(2):  # the repeat resumes from the cache (a snapshot inside the prompt)
        before = computed(daemon)
        prompt, cached = API[api](client, daemon.model, task, stream)
        assert prompt - cached == settled_delta(daemon, before), (api, stream, prompt, cached)
        seen.append(cached)
    if api != "completions":  # a chat prompt has anchors before its end: the repeat reuses
        assert seen[1] > 0
