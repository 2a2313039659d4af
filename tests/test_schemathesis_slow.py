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

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from server_support.daemon import Daemon, start_daemon
from server_support.fuzz import DOC, MAX_MODEL_LEN, OPERATIONS, fuzz_operation

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("FT_SCHEMATHESIS_EXAMPLES", "25"))  # per operation and mode


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
    failures, calls = fuzz_operation(daemon, document, method, path, mode, EXAMPLES)
    assert calls > 0
    assert daemon.proc.poll() is None, "the daemon died:\n" + "".join(daemon.log[-40:])
    assert not failures, f"{len(failures)} of {calls} requests got a 5xx:\n" + "\n".join(
        failures[:10]
    )
