"""Errors the server answers with, and their shape in each API's own dialect.

Route code raises :class:`APIError` (or a subclass); the app's exception handler picks the
dialect from the request path (``/v1/messages*`` is Anthropic, everything else OpenAI) so a
client always gets the error body its SDK parses.
"""

from __future__ import annotations

from typing import Any

import msgspec


class APIError(Exception):
    """An error with an HTTP status, meant for the client (never a 500 for client input)."""

    status: int = 400
    openai_type: str = "invalid_request_error"
    anthropic_type: str = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        self.headers = headers or {}


class InvalidRequest(APIError):
    """400: the body is malformed or a field has a bad value (``param`` names it)."""


class NotFound(APIError):
    """404: no such model, or no such route."""

    status = 404
    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"


class PayloadTooLarge(APIError):
    status = 413
    anthropic_type = "request_too_large"


class Overloaded(APIError):
    """The admission queue is full: OpenAI 429, Anthropic 529 ``overloaded_error``."""

    status = 429
    openai_type = "rate_limit_error"
    anthropic_type = "overloaded_error"


class Unavailable(APIError):
    """The daemon is draining for shutdown (503)."""

    status = 503
    openai_type = "server_error"
    anthropic_type = "api_error"


class InternalError(APIError):
    status = 500
    openai_type = "server_error"
    anthropic_type = "api_error"


class RequestFailed(APIError):
    """This request alone failed inside the engine (its grammar or sampling raised); the
    requests decoding beside it go on."""

    status = 500
    openai_type = "server_error"
    anthropic_type = "api_error"


def is_anthropic_path(path: str) -> bool:
    """The Anthropic Messages API lives under /v1/messages; every other route speaks OpenAI."""
    return path.startswith("/v1/messages")


def error_status(err: APIError, anthropic: bool) -> int:
    """Anthropic spells 'overloaded' as 529; OpenAI clients expect 429 to back off."""
    if anthropic and isinstance(err, Overloaded):
        return 529
    return err.status


def error_body(err: APIError, anthropic: bool) -> dict[str, Any]:
    """The JSON body of an error response in the chosen dialect."""
    if anthropic:
        return {
            "type": "error",
            "error": {"type": err.anthropic_type, "message": err.message},
        }
    return {
        "error": {
            "message": err.message,
            "type": err.openai_type,
            "param": err.param,
            "code": None,
        }
    }


def error_event(err: APIError, anthropic: bool) -> dict[str, Any]:
    """An error raised mid-stream, as the payload of an SSE ``error`` event."""
    return error_body(err, anthropic)


def from_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> InvalidRequest:
    """msgspec says e.g. "Expected `int`, got `str` - at `$.max_tokens`": keep the text, and
    lift the path into ``param`` so OpenAI clients see which field was wrong."""
    text = str(exc)
    param = None
    marker = " - at `$."
    if marker in text:
        param = text.split(marker, 1)[1].rstrip("`")
    # ValidationError subclasses DecodeError: test it first
    if isinstance(exc, msgspec.ValidationError):
        return InvalidRequest(f"Invalid request: {text}", param=param)
    return InvalidRequest(f"The request body is not valid JSON: {text}")
