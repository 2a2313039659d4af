"""Schemathesis against the daemon's own OpenAPI document: no generated request, valid or not,
may get a 5xx (opt-in: ``pytest --runslow``).

Each operation gets a bounded number of schema-valid ("positive") and schema-violating
("negative") requests, generated from a copy of the document with the rules the msgspec
Structs cannot state (each a 400 naming the field) written in: the served model, the APIs'
roles, one choice, non-empty messages and prompts, sampling ranges, and token limits of 1 to
``MAX_GEN`` (never null: null means "the rest of the context"). So positive requests reach the
template, the grammar and the engine instead of stopping at a 400 or 404, and negative ones
break exactly those rules. The daemon's small context keeps fuzzed prompts cheap.
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
LIMIT = {"type": "integer", "minimum": 1, "maximum": MAX_GEN}
OVERRIDES: dict[str, Any] = {  # property name -> its schema in every request Struct
    "max_tokens": LIMIT,
    "max_completion_tokens": LIMIT,
    "max_output_tokens": LIMIT,
    "n": {"const": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
}
NON_EMPTY = ("messages", "input", "prompt")
ROLES = {  # Struct name -> the roles its API defines
    "ChatMessage": ["system", "developer", "user", "assistant", "tool", "function"],
    "Message": ["user", "assistant", "system"],  # system: Claude Code's mid-conversation beta
    "InputItem": ["system", "developer", "user", "assistant", None],
}
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


def non_empty(schema: dict[str, Any]) -> None:
    """Strings and arrays allowed by ``schema`` (or by its ``anyOf`` members) are non-empty."""
    for member in schema.get("anyOf", [schema]):
        if member.get("type") == "array":
            member["minItems"] = 1
        elif member.get("type") == "string":
            member["minLength"] = 1


def bounded(doc: dict[str, Any], model: str) -> dict[str, Any]:
    """A copy of ``doc`` with the request rules above written into its schemas."""
    out = copy.deepcopy(doc)
    for struct, schema in out.get("components", {}).get("schemas", {}).items():
        props = schema.get("properties", {})
        if "model" in props:
            props["model"] = {"type": "string", "enum": [model]}
        if struct in ROLES:
            props["role"] = {"enum": ROLES[struct]}
        for prop, rule in OVERRIDES.items():
            if prop in props:
                props[prop] = copy.deepcopy(rule)
        for prop in NON_EMPTY:
            if prop in props:
                non_empty(props[prop])
    return out


def test_document_covers_every_operation(document: dict[str, Any]) -> None:
    served = {
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method in ("get", "head", "post", "put", "patch", "delete")
    }
    assert served == set(OPERATIONS)


# Negative requests need something to break: only the routes with a body have it.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
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
