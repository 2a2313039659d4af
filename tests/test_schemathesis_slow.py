"""Schemathesis against the daemon's own OpenAPI document: no generated request, valid or not,
may get a 5xx (opt-in: ``pytest --runslow``).

Each operation gets a bounded number of schema-valid ("positive") and schema-violating
("negative") requests. The document is bounded before generation so the run stays short on a
CPU: the daemon's context is small, the token limits (``max_tokens`` and its Responses and
Chat spellings) are at most ``MAX_GEN`` and never null (null means "the rest of the
context"), and positive requests name the served model (else nearly all would stop at the
404 for an unknown model and never reach the template, the grammar or the engine).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from server_support.daemon import Daemon, start_daemon

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

pytestmark = pytest.mark.slow

DOC = "/schema/openapi.json"
MAX_MODEL_LEN = 160  # fuzzed prompts longer than this are a cheap 400
MAX_GEN = 12
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
EXAMPLES = int(os.environ.get("FT_SCHEMATHESIS_EXAMPLES", "25"))  # per operation and mode
REQUEST_TIMEOUT = 300.0  # a busy 2-core machine; a hung daemon still fails

OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/"),
    ("HEAD", "/"),
]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon("--max-model-len", str(MAX_MODEL_LEN))
    yield d
    code = d.stop()
    assert code == 0, "the daemon did not shut down cleanly:\n" + "".join(d.log[-40:])


@pytest.fixture(scope="module")
def document(daemon: Daemon) -> dict[str, Any]:
    status, raw = daemon.get(DOC)
    assert status == 200, raw[:300]
    return json.loads(raw)


def bounded(doc: dict[str, Any], model: str) -> dict[str, Any]:
    """A copy of ``doc`` whose request schemas name ``model`` and cap the token limits."""
    out = copy.deepcopy(doc)
    for schema in out.get("components", {}).get("schemas", {}).values():
        props = schema.get("properties", {})
        if "model" in props:
            props["model"] = {"type": "string", "enum": [model]}
        for name in TOKEN_LIMITS:
            if name in props:
                props[name] = {"type": "integer", "maximum": MAX_GEN}
    return out


def test_document_covers_every_operation(document: dict[str, Any]) -> None:
    served = {
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method in ("get", "head", "post", "put", "patch", "delete")
    }
    assert served == set(OPERATIONS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_no_server_error(
    daemon: Daemon, document: dict[str, Any], method: str, path: str, mode: Any
) -> None:
    schema = schemathesis.openapi.from_dict(bounded(document, daemon.model))
    operation = schema[path][method]
    failures: list[str] = []
    calls = 0

    # Failures are collected, not raised: no shrinking, so the run stays bounded and every
    # distinct 5xx is reported with a curl command that reproduces it.
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        nonlocal calls
        calls += 1
        response = case.call(base_url=daemon.url, timeout=REQUEST_TIMEOUT)
        if response.status_code >= 500:
            failures.append(
                f"{response.status_code}: {case.as_curl_command(base_url=daemon.url)}\n"
                f"  -> {response.text[:400]}"
            )

    run()
    assert calls > 0
    assert daemon.proc.poll() is None, "the daemon died:\n" + "".join(daemon.log[-40:])
    assert not failures, f"{len(failures)} of {calls} requests got a 5xx:\n" + "\n".join(
        failures[:10]
    )
