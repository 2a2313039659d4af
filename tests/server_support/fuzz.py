"""What the schemathesis runs share (the opt-in slow one and the bounded one in ``make test``):
the daemon's OpenAPI document with the rules the msgspec Structs cannot state written in (the
served model, the APIs' roles, one choice, non-empty messages and prompts, sampling ranges,
token limits of 1 to ``MAX_GEN``), so positive requests reach the template, the grammar and
the engine instead of stopping at a 400 or 404, and negative ones break exactly those rules."""

from __future__ import annotations

import copy
from typing import Any

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


REQUEST_TIMEOUT = 300.0  # a busy 2-core machine; a hung daemon still fails


def fuzz_operation(
    daemon: Any, document: dict[str, Any], method: str, path: str, mode: Any, examples: int
) -> tuple[list[str], int]:
    """``examples`` schemathesis requests to one operation: (the 5xx answers, each with a curl
    command that reproduces it, and the number of requests sent)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_dict(bounded(document, daemon.model))
    operation = schema[path][method]
    failures: list[str] = []
    calls = 0

    # Failures are collected, not raised: no shrinking, so the run stays bounded and every
    # distinct 5xx is reported.
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
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
    return failures, calls
