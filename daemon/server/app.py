"""The Litestar application: routes, error shapes, and the engine thread's lifetime."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException
from litestar.plugins.core import MsgspecDIPlugin

from .access import HttpAccess, access_middleware
from .errors import (
    APIError,
    InternalError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    error_body,
    error_status,
    is_anthropic_path,
)
from .openapi import openapi_config
from .routes.anthropic import count_tokens, messages
from .routes.completions import completions
from .routes.misc import get_model, health, list_models, metrics, root, root_head
from .routes.openai_chat import chat_completions
from .routes.responses import responses
from .state import ServerState

log = structlog.get_logger("freetokend.app")

MAX_BODY_BYTES = 32 * 1024 * 1024  # Claude Code sends ~100 KB; 32 MB is generous


class _Litestar(Litestar):
    """Litestar with only the msgspec plugin among its defaults. Its pydantic and attrs plugins
    are added whenever those packages are installed, and importing the pydantic ones (pydantic
    itself, which nothing else in the daemon imports) took 0.17-0.20 s of the start-up on the
    path to ready (AMD EPYC Zen 3, warm): our bodies are msgspec structs and dataclasses, which
    litestar handles without them (the OpenAPI document is the same)."""

    @staticmethod
    def _get_default_plugins(plugins: list[Any]) -> list[Any]:
        return [*plugins, MsgspecDIPlugin()]


def _api_of(path: str) -> str:
    for prefix, name in (
        ("/v1/messages", "messages"),
        ("/v1/responses", "responses"),
        ("/v1/chat", "chat"),
        ("/v1/completions", "completions"),
    ):
        if path.startswith(prefix):
            return name
    return "other"


def _respond(request: Request[Any, Any, Any], err: APIError) -> Response[Any]:
    anthropic = is_anthropic_path(request.url.path)
    status = error_status(err, anthropic)
    state: ServerState | None = getattr(request.app.state, "server", None)
    if state is not None:
        state.metrics.record_request(_api_of(request.url.path), status)
    log.info(
        "request rejected",
        path=request.url.path,
        status=status,
        error=err.message[:300],
    )
    return Response(error_body(err, anthropic), status_code=status, headers=err.headers)


def on_api_error(request: Request[Any, Any, Any], exc: APIError) -> Response[Any]:
    return _respond(request, exc)


def on_http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    """Litestar's own errors (unknown route, wrong method, body too large) in the API's shape."""
    code = exc.status_code
    err: APIError
    if code == 413:
        err = PayloadTooLarge(f"The request body is larger than {MAX_BODY_BYTES} bytes.")
    elif code == 404:
        err = NotFound(f"No route for {request.method} {request.url.path}.")
    elif code == 405:
        err = InvalidRequest(
            f"Method {request.method} is not allowed on {request.url.path}.", status=405
        )
    elif 400 <= code < 500:
        err = InvalidRequest(str(exc.detail), status=code)
    else:
        err = InternalError(str(exc.detail), status=code)
    return _respond(request, err)


def on_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    if isinstance(exc, RecursionError):
        # only untrusted JSON nests this deep: the request's fault, in its API's shape
        log.info("request nested too deeply", path=request.url.path)
        return _respond(request, InvalidRequest("The request's JSON is nested too deeply."))
    log.exception("unhandled error", path=request.url.path)
    return _respond(request, InternalError(f"Internal error: {type(exc).__name__}"))


def create_app(state: ServerState, access: HttpAccess | None = None) -> Litestar:
    """The app; the engine thread starts with the app and stops with it. ``access``: API keys
    and the Host/Origin rules (server/access.py); None = no checks (in-process tests)."""

    async def start_engine() -> None:
        state.bridge.start(asyncio.get_running_loop())

    def stop_engine() -> None:
        state.bridge.stop()

    middleware: list[Any] = [access_middleware(access)] if access is not None else []
    app = _Litestar(
        route_handlers=[
            chat_completions,
            completions,
            responses,
            messages,
            count_tokens,
            list_models,
            get_model,
            health,
            metrics,
            root,
            root_head,
        ],
        exception_handlers={
            APIError: on_api_error,
            HTTPException: on_http_error,
            Exception: on_unexpected,
        },
        on_startup=[start_engine],
        on_shutdown=[stop_engine],
        request_max_body_size=MAX_BODY_BYTES,
        middleware=middleware,
        openapi_config=openapi_config(),
        debug=False,
    )
    app.state.server = state
    return app
