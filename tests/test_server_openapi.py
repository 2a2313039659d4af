"""The daemon's OpenAPI document: every inference route names its request body, and each
referenced schema is in the document (so schemathesis and SDK generators can use it)."""

# ruff: noqa: F811  (pytest fixtures imported by name are redefined as parameters)

from __future__ import annotations

import json

from server_support.daemon import Daemon
from server_support.fixtures import daemon  # noqa: F401  (fixture)

DOC = "/schema/openapi.json"
BODIES = {
    "/v1/chat/completions": ("ChatCompletionRequest", {"model", "messages"}),
    "/v1/completions": ("CompletionRequest", {"model", "prompt"}),
    "/v1/responses": ("ResponsesRequest", {"model", "input"}),
    "/v1/messages": ("MessagesRequest", {"model", "messages", "max_tokens"}),
    "/v1/messages/count_tokens": ("CountTokensRequest", {"model", "messages"}),
}


def refs(node: object) -> set[str]:
    """Every ``$ref`` value under ``node``."""
    if isinstance(node, dict):
        out = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        for value in node.values():
            out |= refs(value)
        return out
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node)) if node else set()
    return set()


def load(daemon: Daemon) -> dict:
    status, raw = daemon.get(DOC)
    assert status == 200
    return json.loads(raw)


def test_document_lists_every_route(daemon: Daemon) -> None:
    doc = load(daemon)
    assert doc["openapi"].startswith("3.")
    assert set(BODIES) | {"/v1/models", "/v1/models/{model_id}", "/health", "/"} <= set(
        doc["paths"]
    )
    assert DOC not in doc["paths"]  # the schema's own routes stay out of it


def test_inference_routes_name_their_body(daemon: Daemon) -> None:
    doc = load(daemon)
    schemas = doc["components"]["schemas"]
    for path, (name, required) in BODIES.items():
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{name}", path
        assert set(schemas[name]["required"]) == required, path
    # Claude Code's fields are in the Anthropic schema, with their wire names
    props = schemas["MessagesRequest"]["properties"]
    assert {"system", "tools", "thinking", "stream", "stop_sequences"} <= set(props)
    assert "schema" in schemas["JsonSchemaSpec"]["properties"]  # renamed field, wire name


def test_every_reference_resolves(daemon: Daemon) -> None:
    doc = load(daemon)
    prefix = "#/components/schemas/"
    found = refs(doc)
    assert found, "no references at all"
    for ref in found:
        assert ref.startswith(prefix), ref
        assert ref[len(prefix) :] in doc["components"]["schemas"], ref


def test_the_app_is_built_without_pydantic(tmp_path) -> None:
    """Litestar's pydantic plugins (and pydantic, imported for them only: 0.17-0.20 s of the
    daemon's start-up) are left out: the bodies are msgspec structs and dataclasses, and the
    document above is built without them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "from server_support.daemon import quiet_control_plane\n"
        "from freetokend.server.app import create_app\n"
        "control = quiet_control_plane()\n"
        "state = control.start()\n"
        "try:\n"
        "    app = create_app(state)\n"
        "finally:\n"
        "    control.stop()\n"
        "print(sorted(type(p).__name__ for p in app.plugins), 'pydantic' in sys.modules)\n"
    )
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    plugins, pydantic = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert "MsgspecDIPlugin" in plugins and "OpenAPIPlugin" in plugins
    assert "Pydantic" not in plugins and pydantic == "False"
