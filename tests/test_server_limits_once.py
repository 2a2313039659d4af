"""A request's limits are checked once, at the server's edge (issue 41, item 4).

The app runs in-process on the built-in model, built as ``serve()`` builds it (control plane,
engine hub, lane bridge). Each API's request goes through HTTP to the engine; the edge's
``check_sampling`` runs once per request and the engine's own guard
(``SamplingParams.validate``, for the offline API) not at all. Refusals keep their 400s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from litestar.testing import TestClient
from server_support.daemon import quiet_control_plane

from freetokend.engine.sampler import SamplingParams
from freetokend.server import chat
from freetokend.server.app import create_app

MODEL = "builtin-qwen35moe-tiny"
HELLO: Any = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient[Any]]:
    control = quiet_control_plane()
    state = control.start()
    try:
        with TestClient(create_app(state)) as tc:
            yield tc
    finally:
        control.stop()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the edge's check and the engine's guard ran."""
    counts = {"check_sampling": 0, "validate": 0}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kw: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kw)

        return wrapper

    from freetokend.server import service

    monkeypatch.setattr(service, "check_sampling", counted("check_sampling", chat.check_sampling))
    monkeypatch.setattr(SamplingParams, "validate", counted("validate", SamplingParams.validate))
    return counts


REQUESTS = [
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 3}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3}),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7]}),  # the API's default 16
    ("/v1/messages", {"model": MODEL, "messages": HELLO, "max_tokens": 3}),
    ("/v1/responses", {"model": MODEL, "input": "Hello", "max_output_tokens": 3}),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO}),  # the rest of the context
]


@pytest.mark.parametrize(("path", "body"), REQUESTS)
def test_limits_are_checked_once_on_the_http_path(
    client: TestClient[Any], calls: dict[str, int], path: str, body: dict[str, Any]
) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert calls == {"check_sampling": 1, "validate": 0}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": 10**9}, "more than the context"),
        ({"seed": 2**70}, "seed out of range"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids must be token ids in [0, "),
        ({"prompt": list(range(5, 100)), "max_tokens": -10}, "This model's context is"),
    ],
)
def test_refusals_are_checked_once_too(
    client: TestClient[Any], calls: dict[str, int], body: dict[str, Any], needle: str
) -> None:
    if body.get("max_tokens", 0) < 0:  # this many under the context: with the prompt, over it
        body = {
            **body,
            "max_tokens": client.app.state.server.service.max_model_len + body["max_tokens"],
        }
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text
    assert calls == {"check_sampling": 1, "validate": 0}


def test_the_offline_api_keeps_its_guard(builtin_model_dir: Any) -> None:
    from freetokend.engine.llm import LLM

    llm = LLM(builtin_model_dir, max_model_len=64, kv_tokens=256, prefix_cache=False)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([5, 6], max_tokens=2, temperature=-1.0)
    with pytest.raises(ValueError, match="exceeds the context"):
        llm.generate([5, 6], max_tokens=63)
