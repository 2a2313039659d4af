"""Provider configuration of the coding agents ``ftctl launch`` starts, pointed at the daemon.

Each agent gets its own files under ``$XDG_CONFIG_HOME/freetoken/agents/<agent>/`` (never the
user's own agent configuration), and is started with the flag or environment variable that
makes it read them:

claude    settings.json ({"env": ...}) via ``claude --settings FILE``: the Anthropic API
          (/v1/messages) at the daemon, the daemon's model for every model slot
codex     CODEX_HOME=<dir> with config.toml: a ``freetoken`` model provider on the OpenAI
          Responses API (/v1/responses)
opencode  OPENCODE_CONFIG=<file>: an OpenAI-compatible provider (/v1/chat/completions)
openclaw  OPENCLAW_CONFIG_PATH=<file>: a provider on the OpenAI completions API
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

AGENTS = ("claude", "codex", "opencode", "openclaw")
# What agents get when the daemon needs no key (they insist on having one)
PLACEHOLDER_KEY = "freetoken"
KEY_ENV = "FREETOKEN_API_KEY"  # Codex reads its provider's key from this variable (env_key)


@dataclass
class AgentLaunch:
    agent: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[Path, str] = field(default_factory=dict)


def config_home(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ if env is None else env)
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "freetoken" / "agents"


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def build(
    agent: str,
    url: str,
    model: str,
    context: int,
    home: Path,
    extra_args: list[str],
    api_key: str = "",
) -> AgentLaunch:
    """The files, environment and command line that start ``agent`` against ``url``, sending
    ``api_key`` (the daemon's, or a placeholder when it needs none) the agent's own way."""
    folder = home / agent
    key = api_key or PLACEHOLDER_KEY
    v1 = url.rstrip("/") + "/v1"
    if agent == "claude":
        settings = folder / "settings.json"
        env = {
            "ANTHROPIC_BASE_URL": url.rstrip("/"),
            "ANTHROPIC_AUTH_TOKEN": key,  # sent as Authorization: Bearer
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        text = json.dumps({"env": env, "model": model}, indent=2) + "\n"
        return AgentLaunch(agent, ["claude", "--settings", str(settings), *extra_args],
                           files={settings: text})  # fmt: skip
    if agent == "codex":
        text = (
            f"model = {_toml_str(model)}\n"
            'model_provider = "freetoken"\n'
            f"model_context_window = {context}\n\n"
            "[model_providers.freetoken]\n"
            'name = "freetoken (local daemon)"\n'
            f"base_url = {_toml_str(v1)}\n"
            f"env_key = {_toml_str(KEY_ENV)}\n"
            'wire_api = "responses"\n'
        )
        return AgentLaunch(agent, ["codex", *extra_args],
                           {"CODEX_HOME": str(folder), KEY_ENV: key},
                           {folder / "config.toml": text})  # fmt: skip
    if agent == "opencode":
        cfg = {
            "$schema": "https://opencode.ai/config.json",
            "model": f"freetoken/{model}",
            "provider": {
                "freetoken": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "freetoken (local daemon)",
                    "options": {"baseURL": v1, "apiKey": key},
                    "models": {
                        model: {
                            "name": model,
                            "limit": {"context": context, "output": min(context, 32000)},
                        }
                    },
                }
            },
        }
        path = folder / "opencode.json"
        return AgentLaunch(agent, ["opencode", *extra_args], {"OPENCODE_CONFIG": str(path)},
                           {path: json.dumps(cfg, indent=2) + "\n"})  # fmt: skip
    if agent == "openclaw":
        cfg = {
            "agents": {"defaults": {"model": {"primary": f"freetoken/{model}"}}},
            "models": {
                "providers": {
                    "freetoken": {
                        "baseUrl": v1,
                        "apiKey": key,
                        "api": "openai-completions",
                        "models": [{"id": model, "name": model, "contextWindow": context,
                                    "maxTokens": min(context, 32000)}],
                    }
                }
            },
        }  # fmt: skip
        path = folder / "openclaw.json"
        return AgentLaunch(agent, ["openclaw", *extra_args], {"OPENCLAW_CONFIG_PATH": str(path)},
                           {path: json.dumps(cfg, indent=2) + "\n"})  # fmt: skip
    raise ValueError(f"unknown agent {agent!r}; choose one of {', '.join(AGENTS)}")
