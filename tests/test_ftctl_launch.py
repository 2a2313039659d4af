"""ftctl launch: each agent's provider configuration points at the daemon (no daemon needed)."""

from __future__ import annotations

import json
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
        assert launch.env == {"CODEX_HOME": str(path.parent)}
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
