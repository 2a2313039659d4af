"""Small endpoints: models list, health, metrics, and the root (Claude Code's HEAD / warm-up)."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Request, Response, get, head
from litestar.params import PathParameter
from litestar.response import Response as PlainResponse

from ..state import server_state


def model_card(request: Request[Any, Any, Any]) -> dict[str, Any]:
    svc = server_state(request).service
    return {
        "id": svc.name,
        "object": "model",
        "created": int(server_state(request).metrics.started),
        "owned_by": "freetoken",
        "max_model_len": svc.max_model_len,
        # Anthropic's /v1/models fields, so either SDK can list it
        "type": "model",
        "display_name": svc.name,
        "created_at": "1970-01-01T00:00:00Z",
    }


@get("/v1/models", sync_to_thread=False)
def list_models(request: Request[Any, Any, Any]) -> dict[str, Any]:
    card = model_card(request)
    return {
        "object": "list",
        "data": [card],
        "has_more": False,
        "first_id": card["id"],
        "last_id": card["id"],
    }


@get("/v1/models/{model_id:str}", sync_to_thread=False)
def get_model(
    request: Request[Any, Any, Any], model_id: Annotated[str, PathParameter()]
) -> dict[str, Any]:
    # a lookup, not a request to serve: names no model has are 404 even when not strict
    server_state(request).service.check_model(model_id, serve_unknown=False)
    return model_card(request)


@get("/health", sync_to_thread=False)
def health(request: Request[Any, Any, Any]) -> Response[Any]:
    state = server_state(request)
    body = {
        "status": "draining" if state.draining else "ok",
        "model": state.service.name,
        "in_flight": state.bridge.in_flight,
    }
    return Response(body, status_code=503 if state.draining else 200)


@get("/", sync_to_thread=False)
def root() -> dict[str, Any]:
    """A liveness page, open without a key as llama.cpp's root is: it names nothing a keyless
    caller could not guess (no model, no load; /v1/models is behind the key)."""
    return {"name": "freetokend", "status": "ok"}


@head("/", sync_to_thread=False)
def root_head() -> None:
    return None


@get("/metrics", sync_to_thread=False, media_type="text/plain; version=0.0.4")
def metrics(request: Request[Any, Any, Any]) -> PlainResponse[str]:
    state = server_state(request)
    text = state.metrics.render(state.bridge.stats, state.bridge.in_flight, state.draining)
    return PlainResponse(text, media_type="text/plain; version=0.0.4")
