"""Who may call the HTTP API (issue 15): API keys (Bearer or x-api-key, 401 in each API's
error shape otherwise, the health check and Claude Code's HEAD / warm-up open), and on the
default loopback bind the Host/Origin checks that keep web pages out (a cross-site POST with
a text/plain body needs no preflight; a DNS-rebinding page sends a foreign Host)."""

# ruff: noqa: F811  (pytest fixtures imported by name are redefined as parameters)

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from server_support.daemon import CLIENT_TIMEOUT, Daemon, start_daemon
from server_support.fixtures import daemon  # noqa: F401

from freetokend.cli import build_parser
from freetokend.config import ConfigError, resolve
from freetokend.server.access import OPEN_ROUTES, HttpAccess, is_loopback_name

KEYS = ("sk-first-key", "second.key")


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def message(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def request(
    d: Daemon, method: str, path: str, body: dict | bytes | None = None, **headers: str
) -> tuple[int, dict, dict[str, str]]:
    """One raw request (http.client: the Host header can be anything)."""
    u = urlparse(d.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=CLIENT_TIMEOUT)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {k.replace("_", "-"): v for k, v in headers.items()}
    if data is not None:
        hdrs.setdefault("content-type", "application/json")
        hdrs["content-length"] = str(len(data))
    skip_host = "host" in {k.lower() for k in hdrs}
    conn.putrequest(method, path, skip_host=skip_host)
    for k, v in hdrs.items():
        conn.putheader(k, v)
    conn.endheaders(data)
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    try:
        parsed = json.loads(raw) if raw else {}
    except ValueError:
        parsed = {"raw": raw.decode("utf-8", "replace")}
    return r.status, parsed, {k.lower(): v for k, v in r.getheaders()}


# ---- the rules, without a server ---------------------------------------------------------


def test_loopback_names() -> None:
    for name in ("localhost", "LOCALHOST.", "app.localhost", "127.0.0.1", "127.9.9.9", "::1"):
        assert is_loopback_name(name), name
    for name in ("evil.example", "localhost.evil.example", "0.0.0.0", "10.0.0.1", "", "::"):
        assert not is_loopback_name(name), name


def test_rules() -> None:
    acc = HttpAccess.build(KEYS, "127.0.0.1")
    ok = {"host": "127.0.0.1:1919", "authorization": f"Bearer {KEYS[0]}"}
    assert acc.refusal("POST", "/v1/chat/completions", ok) is None
    assert acc.refusal("POST", "/v1/messages", {"x-api-key": KEYS[1]}) is None
    assert acc.refusal("POST", "/v1/messages", {"authorization": "bearer " + KEYS[1]}) is None
    for bad in (
        {},
        {"x-api-key": "nope"},
        {"authorization": KEYS[0]},
        {"authorization": "Bearer "},
    ):
        err = acc.refusal("POST", "/v1/chat/completions", bad)
        assert err is not None and err.status == 401, bad
    assert acc.refusal("GET", "/v1/models", {}) is not None
    assert acc.refusal("GET", "/metrics", {}) is not None
    for method, path in (("HEAD", "/"), ("GET", "/"), ("GET", "/health"), ("HEAD", "/health")):
        assert acc.refusal(method, path, {}) is None  # warm-up, liveness and health: no key
    for method, path in (("POST", "/"), ("GET", "/v1/models"), ("GET", "/health/x")):
        assert acc.refusal(method, path, {}) is not None, (method, path)
    # browsers: Host (DNS rebinding) and Origin, even with a good key
    for hdrs in (
        {"host": "evil.example:1919"},
        {"origin": "https://evil.example"},
        {"origin": "null"},
        {"sec-fetch-site": "cross-site"},
    ):
        err = acc.refusal("POST", "/v1/chat/completions", {**ok, **hdrs})
        assert err is not None and err.status == 403, hdrs
        assert acc.refusal("HEAD", "/", hdrs) is not None, hdrs
    for hdrs in (
        {"host": "localhost:1919", "origin": "http://localhost:3000"},
        {"host": "[::1]:1919", "origin": "http://127.0.0.1:1919"},
        {"sec-fetch-site": "same-origin"},
    ):
        assert acc.refusal("POST", "/v1/chat/completions", {**ok, **hdrs}) is None, hdrs
    # a wider bind cannot know its names: no Host check; Origin still checked
    wide = HttpAccess.build((), "0.0.0.0")
    assert wide.refusal("POST", "/v1/chat/completions", {"host": "box.lan:1919"}) is None
    assert wide.refusal("POST", "/v1/chat/completions", {"origin": "http://box.lan"}) is not None
    allow = HttpAccess.build((), "127.0.0.1", ["proxy.lan"], ["https://ui.example/"])
    hdrs = {"host": "proxy.lan", "origin": "https://ui.example"}
    assert allow.refusal("POST", "/v1/chat/completions", hdrs) is None


def test_key_config() -> None:
    env = {"FREETOKEN_STATE_DIR": "/s"}
    assert resolve({}, None, env=env).api_keys == ()
    assert resolve({}, None, env={**env, "FREETOKEN_API_KEY": "a,b"}).api_keys == ("a", "b")
    args = vars(build_parser().parse_args(["--api-key", "x", "--api-key", "y"]))
    args.pop("config")
    assert resolve(args, None, env=env).api_keys == ("x", "y")
    with pytest.raises(ConfigError, match="api_key: key 2 has a space") as e:
        resolve({"api_key": ["good", "with space"]}, None, env=env)
    assert "with space" not in str(e.value)  # an error never repeats a key
    with pytest.raises(ConfigError, match="key 1 is empty"):
        resolve({"api_key": ""}, None, env={**env})


# ---- the default daemon (no key, loopback): browsers are kept out ------------------------


def test_cross_site_text_plain_post_is_refused(daemon) -> None:
    """What a web page can send without a preflight: a text/plain POST with its Origin."""
    body = json.dumps(chat(daemon.model)).encode()
    status, err, _ = request(
        daemon, "POST", "/v1/chat/completions", body,
        content_type="text/plain", origin="https://evil.example",
    )  # fmt: skip
    assert status == 403 and "Cross-site" in err["error"]["message"]
    status, err, _ = request(
        daemon, "POST", "/v1/messages", message(daemon.model), origin="https://evil.example"
    )
    assert status == 403 and err["type"] == "error"
    assert err["error"]["type"] == "permission_error"


def test_dns_rebinding_host_is_refused(daemon) -> None:
    status, err, _ = request(daemon, "GET", "/v1/models", host="evil.example:1919")
    assert status == 403 and "DNS rebinding" in err["error"]["message"]
    status, _, _ = request(daemon, "GET", "/v1/models", host="localhost:1919")
    assert status == 200


# ---- a daemon with keys ------------------------------------------------------------------


def test_the_readme_names_the_open_routes() -> None:
    """The README's security paragraph and OPEN_ROUTES agree: they once disagreed on GET /
    (the README said only HEAD / was open)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    said = re.search(r"every route but (.*?) then needs it", readme, re.S)
    assert said is not None
    paths = set(re.findall(r"`(/[^`\s]*)`", said.group(1)))
    assert paths == {"/health", "/"}, said.group(1)
    assert OPEN_ROUTES == {(m, p) for p in paths for m in ("GET", "HEAD")}


@pytest.fixture(scope="module")
def keyed() -> Iterator[Daemon]:
    d = start_daemon("--api-key", KEYS[0], "--api-key", KEYS[1])
    yield d
    d.stop()


def test_missing_or_wrong_key_is_401_in_each_api_shape(keyed: Daemon) -> None:
    status, err, hdrs = request(keyed, "POST", "/v1/chat/completions", chat(keyed.model))
    assert status == 401 and err["error"]["type"] == "invalid_request_error"
    assert "API key" in err["error"]["message"] and hdrs["www-authenticate"] == "Bearer"
    status, err, _ = request(keyed, "POST", "/v1/messages", message(keyed.model), x_api_key="wrong")
    assert status == 401 and err == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Invalid API key."},
    }
    for path in ("/v1/models", "/metrics", "/v1/responses"):
        method = "POST" if path == "/v1/responses" else "GET"
        assert request(keyed, method, path, {} if method == "POST" else None)[0] == 401, path


def test_each_key_in_each_header_is_accepted(keyed: Daemon) -> None:
    import anthropic
    import openai

    oa = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS[0], max_retries=0,
                       timeout=CLIENT_TIMEOUT)  # fmt: skip
    assert [m.id for m in oa.models.list()] == [keyed.model]  # Authorization: Bearer
    an = anthropic.Anthropic(base_url=keyed.url, api_key=KEYS[1], max_retries=0,
                             timeout=CLIENT_TIMEOUT)  # fmt: skip
    counted = an.messages.count_tokens(model=keyed.model, messages=message(keyed.model)["messages"])
    assert counted.input_tokens > 0  # x-api-key
    # Claude Code (ANTHROPIC_AUTH_TOKEN) sends the key to /v1/messages as a bearer token
    status, body, _ = request(
        keyed, "POST", "/v1/messages/count_tokens?beta=true", message(keyed.model),
        authorization=f"Bearer {KEYS[1]}",
    )  # fmt: skip
    assert status == 200 and body["input_tokens"] > 0
    for hdrs in ({"authorization": f"Bearer {KEYS[1]}"}, {"x_api_key": KEYS[0]}):
        assert request(keyed, "GET", "/v1/models", **hdrs)[0] == 200, hdrs


def test_warm_up_and_health_need_no_key(keyed: Daemon) -> None:
    assert request(keyed, "HEAD", "/")[0] == 200  # Claude Code's first request
    assert request(keyed, "GET", "/health")[0] == 200
    # the root is open as the README says, and names nothing (the model is behind the key)
    status, body, _ = request(keyed, "GET", "/")
    assert (status, body) == (200, {"name": "freetokend", "status": "ok"})
    assert request(keyed, "GET", "/v1/models")[0] == 401
