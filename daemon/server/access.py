"""Who may call the HTTP API: API keys, and the Host/Origin checks that keep browsers out.

Threats (issue 15), for a daemon on the default loopback bind:
- any web page the user opens can POST to http://127.0.0.1:1919 (a ``text/plain`` body needs
  no CORS preflight): it cannot read the answer, but it can spend the machine. Browsers send
  ``Origin`` on every cross-origin POST, so a request whose Origin is not a loopback origin
  (or one of ``allowed_origins``) is refused, as is any request a browser marks
  ``Sec-Fetch-Site: cross-site``;
- a DNS-rebinding page (evil.example resolving to 127.0.0.1) is same-origin to the browser
  and can read answers; its requests carry ``Host: evil.example:1919``. On a loopback bind,
  a Host that is not a loopback name (or one of ``allowed_hosts``) is refused.
- other local users and, on a wider bind, the network: ``api_key`` (one or more keys) is then
  required on every route but the health check and Claude Code's ``HEAD /`` warm-up, sent as
  ``Authorization: Bearer KEY`` (OpenAI SDKs, Claude Code's ANTHROPIC_AUTH_TOKEN) or
  ``x-api-key: KEY`` (Anthropic SDKs). Keys are compared in constant time.

Refusals use the API's own error shape (``errors.error_body``): 401 ``authentication_error``
for a missing or wrong key, 403 ``permission_error`` for a refused Host or Origin.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import structlog

from .errors import APIError, error_body, error_status, is_anthropic_path

log = structlog.get_logger("freetokend.access")

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

# Reachable without a key: liveness probes (/health; GET / is a page that names nothing, as a
# llama.cpp user finds its root open) and Claude Code's warm-up (it sends HEAD / first).
OPEN_ROUTES = frozenset({("GET", "/health"), ("HEAD", "/health"), ("HEAD", "/"), ("GET", "/")})


class Unauthorized(APIError):
    status = 401
    openai_type = "invalid_request_error"
    anthropic_type = "authentication_error"


class Forbidden(APIError):
    status = 403
    openai_type = "invalid_request_error"
    anthropic_type = "permission_error"


def is_loopback_name(host: str) -> bool:
    """``localhost``, a ``*.localhost`` name (RFC 6761: always loopback, browsers never ask
    DNS for them) or a loopback IP literal (127.0.0.0/8, ::1)."""
    host = host.strip().lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The name in a Host header value (``name:port``, ``[v6]:port``)."""
    value = value.strip()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class HttpAccess:
    """The access rules of one daemon (from its config)."""

    key_digests: tuple[bytes, ...] = ()  # SHA-256 of each accepted key; () = no key needed
    check_host: bool = False  # a loopback bind: Host must be a loopback name or allowed
    allowed_hosts: frozenset[str] = frozenset()
    allowed_origins: frozenset[str] = frozenset()

    @classmethod
    def build(
        cls,
        keys: Iterable[str] = (),
        bind_host: str = "127.0.0.1",
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
    ) -> HttpAccess:
        return cls(
            tuple(_digest(k) for k in keys),
            is_loopback_name(bind_host),
            frozenset(h.strip().lower() for h in allowed_hosts),
            frozenset(o.strip().lower().rstrip("/") for o in allowed_origins),
        )

    @classmethod
    def from_config(cls, cfg: Any) -> HttpAccess:
        return cls.build(cfg.api_keys, cfg.host, cfg.allowed_hosts, cfg.allowed_origins)

    # ---- the checks ---------------------------------------------------------------------------
    def refusal(self, method: str, path: str, headers: dict[str, str]) -> APIError | None:
        """Why this request is refused (None: let it through). ``headers``: lower-case names."""
        bad = self._browser_refusal(headers)
        if bad is not None:
            return bad
        if not self.key_digests or (method, path) in OPEN_ROUTES:
            return None
        offered = _offered_keys(headers)
        if not offered:
            return Unauthorized(
                "Missing API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not any(self._known(k) for k in offered):
            return Unauthorized("Invalid API key.", headers={"WWW-Authenticate": "Bearer"})
        return None

    def _known(self, key: str) -> bool:
        d = _digest(key)
        hits = [hmac.compare_digest(d, k) for k in self.key_digests]  # every key: no early exit
        return any(hits)

    def _browser_refusal(self, headers: dict[str, str]) -> APIError | None:
        host = headers.get("host")
        if self.check_host and host is not None and "*" not in self.allowed_hosts:
            name = _host_name(host).lower()
            if not is_loopback_name(name) and name not in self.allowed_hosts:
                return Forbidden(
                    f"Host {host!r} is not a loopback name: this daemon listens on loopback "
                    "and refuses other names (DNS rebinding). Allow it with allowed_hosts."
                )
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin):
            return Forbidden(
                f"Cross-site browser requests are refused (Origin {origin!r}). "
                "Allow the origin with allowed_origins."
            )
        if origin is None and headers.get("sec-fetch-site") == "cross-site":
            if "*" not in self.allowed_origins:
                return Forbidden("Cross-site browser requests are refused.")
        return None

    def _origin_ok(self, origin: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and is_loopback_name(parts.hostname or "")


def _offered_keys(headers: dict[str, str]) -> list[str]:
    keys = []
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if headers.get("x-api-key", "").strip():
        keys.append(headers["x-api-key"].strip())
    return keys


def access_middleware(access: HttpAccess) -> Callable[[ASGIApp], ASGIApp]:
    """An ASGI middleware factory (Litestar ``middleware=``) enforcing ``access``."""

    def factory(app: ASGIApp) -> ASGIApp:
        async def guarded(scope: Scope, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            path = scope.get("path", "")
            err = access.refusal(scope.get("method", "GET"), path, headers)
            if err is None:
                await app(scope, receive, send)
                return
            await _refuse(send, err, path)

        return guarded

    return factory


async def _refuse(send: Any, err: APIError, path: str) -> None:
    anthropic = is_anthropic_path(path)
    status = error_status(err, anthropic)
    log.info("request refused", path=path[:200], status=status, error=err.message[:200])
    body = msgspec.json.encode(error_body(err, anthropic))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in err.headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
