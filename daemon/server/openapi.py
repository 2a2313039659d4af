"""The OpenAPI document, served at ``GET /schema/openapi.json``.

Litestar lists the routes, but the inference routes read their body themselves (``decode_body``
with a msgspec Struct, so errors name the field in the API's own shape), so Litestar cannot see
the request body. A route names its Struct with ``operation_class=body_operation(Struct)``: the
operation's ``requestBody`` refers to ``components/schemas/<Struct name>``, and the served
document gets those schemas (msgspec's JSON Schema of each Struct and the Structs it uses) when
it is rendered: Litestar rebuilds ``components/schemas`` from its own registry, dropping any
given in the config. Clients and fuzzers (schemathesis) then see what each route takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec
from litestar import Request
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import OpenAPIMediaType, Operation, Reference, RequestBody

SCHEMA_PATH = "/schema"  # the document: SCHEMA_PATH + "/openapi.json"
_REF = "#/components/schemas/{name}"
_BODIES: list[type] = []  # every Struct a route declared, in declaration order


def body_operation(kind: type) -> type[Operation]:
    """An Operation class whose ``requestBody`` is the JSON Schema of ``kind`` (a Struct)."""
    _BODIES.append(kind)
    ref = _REF.format(name=kind.__name__)

    @dataclass
    class BodyOperation(Operation):
        def __post_init__(self) -> None:
            self.request_body = RequestBody(
                content={"application/json": OpenAPIMediaType(schema=Reference(ref=ref))},
                required=True,
            )

    return BodyOperation


def body_schemas() -> dict[str, Any]:
    """``components/schemas``: the declared Structs and every Struct they use, by class name."""
    if not _BODIES:
        return {}
    _, components = msgspec.json.schema_components(_BODIES, ref_template=_REF)
    return components


class JsonWithBodies(JsonRenderPlugin):
    """Litestar's JSON document plus the request body schemas (added once; the dict is cached)."""

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        schemas = openapi_schema.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in body_schemas().items():
            schemas.setdefault(name, schema)
        return super().render(request, openapi_schema)


def _version() -> str:
    try:
        return version("freetoken")
    except PackageNotFoundError:
        return "0"


def openapi_config() -> OpenAPIConfig:
    """JSON only: no HTML viewer (those load scripts from a CDN; the daemon may be offline)."""
    return OpenAPIConfig(
        title="freetokend",
        version=_version(),
        description="OpenAI- and Anthropic-compatible inference API of the freetoken daemon.",
        path=SCHEMA_PATH,
        render_plugins=[JsonWithBodies()],
    )
