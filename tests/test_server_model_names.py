"""Model names (issue 15, item 8): a name no model has is answered by the active model, which
the response names (one log line per new name); ``strict_model_names`` makes it a 404;
``model_aliases`` maps names to models."""

# ruff: noqa: F811  (pytest fixtures imported by name are redefined as parameters)

from __future__ import annotations

import time
import uuid

import pytest
from server_support.daemon import MODEL_NAME, start_daemon
from server_support.fixtures import daemon  # noqa: F401

HELLO = [{"role": "user", "content": "Hello"}]


def _chat(d, model: str):
    return d.post("/v1/chat/completions", {"model": model, "messages": HELLO, "max_tokens": 2})


def _anthropic(d, model: str):
    return d.post("/v1/messages", {"model": model, "messages": HELLO, "max_tokens": 2})


def _log_lines(d, needle: str) -> int:
    """Lines naming ``needle`` once the daemon's log caught up with the requests sent so far:
    a fence request with a new name logs after them (one stream, read in order by a thread),
    so waiting for its line, not a fixed time, makes every earlier line visible."""
    fence = f"fence-{uuid.uuid4().hex[:8]}"
    assert _chat(d, fence)[0] == 200
    deadline = time.monotonic() + 60
    while not any(fence in line for line in d.log):
        assert time.monotonic() < deadline, "the fence request's log line never came"
        time.sleep(0.05)
    return sum(needle in line for line in d.log)


def test_unknown_name_is_served_by_the_active_model(daemon):
    name = f"claude-test-{uuid.uuid4().hex[:8]}"
    status, body = _chat(daemon, name)
    assert status == 200, body
    assert body["model"] == daemon.model  # the response names the model that answered
    status, body = _anthropic(daemon, name)
    assert status == 200 and body["model"] == daemon.model, body
    status, body = daemon.post(
        "/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 2}
    )
    assert status == 200 and body["model"] == daemon.model, body
    assert _log_lines(daemon, name) == 1  # one line per new name, not one per request


@pytest.fixture(scope="module")
def strict():
    d = start_daemon("--strict-model-names", "true", "--model-alias", f"my-alias={MODEL_NAME}")
    yield d
    d.stop()


def test_strict_names_are_404_and_aliases_map(strict):
    status, body = _chat(strict, "gpt-4")
    assert status == 404 and "gpt-4" in body["error"]["message"], body
    status, body = _anthropic(strict, "claude-x")
    assert status == 404 and body["error"]["type"] == "not_found_error", body
    status, body = _chat(strict, "my-alias")
    assert status == 200 and body["model"] == strict.model, body
