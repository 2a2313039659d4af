"""ftctl launch: each agent's provider configuration points at the daemon (no daemon needed)."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

from ftctl.agents import AGENTS, build
from ftctl.main import main

URL, MODEL, CTX = "http://127.0.0.1:1919", "qwen3-tiny", 8192


@pytest.mark.parametrize("agent", AGENTS)
def test_agent_configuration(agent: str, tmp_path: Path) -> None:
    launch = build(agent, URL, MODEL, CTX, tmp_path, ["--flag"])
    assert launch.argv[0] == agent and launch.argv[-1] == "--flag"
    ((path, text),) = launch.files.items()
    assert path.parent == tmp_path / agent
    if agent == "claude":
        env = json.loads(text)["env"]
        assert env["ANTHROPIC_BASE_URL"] == URL and env["ANTHROPIC_MODEL"] == MODEL
        assert launch.argv[1:3] == ["--settings", str(path)]
    elif agent == "codex":
        cfg = tomllib.loads(text)
        provider = cfg["model_providers"][cfg["model_provider"]]
        assert provider["base_url"] == URL + "/v1" and cfg["model"] == MODEL
        assert provider["wire_api"] == "responses" and cfg["model_context_window"] == CTX
        assert launch.env == {"CODEX_HOME": str(path.parent), "FREETOKEN_API_KEY": "freetoken"}
        assert provider["env_key"] == "FREETOKEN_API_KEY"
    elif agent == "opencode":
        cfg = json.loads(text)
        provider = cfg["provider"]["freetoken"]
        assert provider["options"]["baseURL"] == URL + "/v1"
        assert cfg["model"] == f"freetoken/{MODEL}" and MODEL in provider["models"]
        assert launch.env == {"OPENCODE_CONFIG": str(path)}
    else:
        cfg = json.loads(text)
        provider = cfg["models"]["providers"]["freetoken"]
        assert provider["baseUrl"] == URL + "/v1" and provider["api"] == "openai-completions"
        assert cfg["agents"]["defaults"]["model"]["primary"] == f"freetoken/{MODEL}"
        assert provider["models"][0]["contextWindow"] == CTX
        assert launch.env == {"OPENCLAW_CONFIG_PATH": str(path)}


def test_dry_run_writes_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    args = ["launch", "codex", "--dry-run", "--url", "http://0.0.0.0:1919", "--model", MODEL]
    assert main([*args, "--context", "4096", "--", "--full-auto"]) == 0
    out = capsys.readouterr().out
    assert 'base_url = "http://127.0.0.1:1919/v1"' in out  # wildcard address -> loopback
    assert out.rstrip().endswith("codex --full-auto")
    assert not (tmp_path / "freetoken").exists()


def test_missing_agent_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no agent installed
    rc = main(["launch", "opencode", "--url", URL, "--model", MODEL, "--context", "4096"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("ftctl: opencode is not installed") and err.count("\n") == 1
    assert (tmp_path / "freetoken/agents/opencode/opencode.json").is_file()


# ---- the daemon's API key reaches the agent (issue 15) ---------------------------------------

KEY = "sk-daemon-key"


def agent_key(agent: str, launch) -> str:  # type: ignore[no-untyped-def]
    """The key the agent will send, read from its configuration as the agent reads it."""
    ((path, text),) = launch.files.items()
    if agent == "claude":
        return json.loads(text)["env"]["ANTHROPIC_AUTH_TOKEN"]
    if agent == "codex":
        provider = tomllib.loads(text)["model_providers"]["freetoken"]
        return launch.env[provider["env_key"]]
    if agent == "opencode":
        return json.loads(text)["provider"]["freetoken"]["options"]["apiKey"]
    return json.loads(text)["models"]["providers"]["freetoken"]["apiKey"]


@pytest.mark.parametrize("agent", AGENTS)
def test_each_agent_sends_the_key(agent: str, tmp_path: Path) -> None:
    assert agent_key(agent, build(agent, URL, MODEL, CTX, tmp_path, [], KEY)) == KEY


class StatusOps:
    """An admin socket whose daemon requires KEY."""

    def status(self) -> dict:
        return {"http_url": URL, "active_model": MODEL, "api_key": KEY}

    def models(self) -> dict:
        return {"models": [{"name": MODEL, "max_model_len": CTX}], "host_budget_bytes": 0,
                "host_used_bytes": 0, "auto_switch": False}  # fmt: skip


@pytest.fixture()
def keyed_socket():  # type: ignore[no-untyped-def]
    import shutil
    import tempfile

    from freetokend.admin.server import AdminServer

    d = Path(tempfile.mkdtemp(prefix="ftl-", dir="/tmp"))
    server = AdminServer(StatusOps(), d / "admin.sock")  # type: ignore[arg-type]
    server.start()
    yield str(d / "admin.sock")
    server.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("agent", AGENTS)
def test_launch_passes_the_daemons_key_in_private_files(
    agent: str, keyed_socket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    import stat

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no agent installed: files written, then exit 1
    monkeypatch.delenv("FREETOKEN_API_KEY", raising=False)
    old = os.umask(0o022)
    try:
        assert main(["launch", agent, "--socket", keyed_socket]) == 1
    finally:
        os.umask(old)
    assert "is not installed" in capsys.readouterr().err
    launch = build(agent, URL, MODEL, CTX, tmp_path / "freetoken" / "agents", [], KEY)
    ((path, text),) = launch.files.items()
    assert path.read_text() == text and agent_key(agent, launch) == KEY
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
