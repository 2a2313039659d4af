"""Real coding agents against the daemon: Claude Code (Anthropic Messages), Codex CLI (OpenAI
Responses) and OpenCode (OpenAI Chat Completions), one headless one-prompt run each.

Opt-in (``pytest --runslow``, or ``make test-slow``, which installs the pinned clients from npm
into ``.agents/``; ``FT_AGENTS_DIR`` points elsewhere). The tiny model's words are nonsense;
what is tested is that each client accepts our responses: it exits 0 with its normal "done"
output, and the daemon's log shows its requests, none rejected, all answered 200, the answer
generated to its end.

The clients talk to 127.0.0.1 only: a clean environment (no real keys, a temporary HOME),
fake API keys, and every telemetry / auto-update / non-essential-traffic switch they have.
A cold run prefills the clients' whole prompts (Claude Code's is ~35 K tokens) on the CPU:
minutes each on a busy 2-core machine, hence ``FT_AGENT_TIMEOUT`` (seconds, default 1800).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from server_support.daemon import REPO, Daemon, start_daemon

pytestmark = pytest.mark.slow

SERVED = "freetoken-tiny"  # --served-model-name; each client is configured to ask for it
PROMPT = "Say hello."
TIMEOUT = float(os.environ.get("FT_AGENT_TIMEOUT", "1800"))
CONTEXT = 131072  # what the clients are told (the built-in model serves this much)


def client(name: str) -> Path:
    folder = Path(os.environ.get("FT_AGENTS_DIR") or REPO / ".agents")
    path = folder / "node_modules" / ".bin" / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in {folder} (make install-agents)")
    return path


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon("--served-model-name", SERVED)
    yield d
    d.stop()


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    records: list[dict[str, Any]]  # the daemon's log records written during the run

    def report(self) -> str:
        return (
            f"exit {self.code}\n--- stdout (tail)\n{self.stdout[-3000:]}\n"
            f"--- stderr (tail)\n{self.stderr[-3000:]}\n--- daemon records\n"
            + "\n".join(json.dumps(r)[:300] for r in self.records[-20:])
        )


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: nothing of the real user's (keys, config, proxies) leaks in."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_PROXY": "127.0.0.1,localhost",
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
    }


def run_client(daemon: Daemon, argv: list[str], env: dict[str, str], cwd: Path) -> Run:
    """Run one client to completion (its whole process group is killed on timeout)."""
    assert daemon.log_path is not None
    offset = daemon.log_path.stat().st_size
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,  # node launchers spawn native binaries: kill them all
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[test] killed after {TIMEOUT:.0f} s"
    settle(daemon)
    return Run(proc.returncode, out, err, read_records(daemon.log_path, offset))


def settle(daemon: Daemon, timeout: float = 30) -> None:
    """Wait until the daemon has finished (and so logged) every request of the client: a
    client may exit the moment it has its answer, just before the daemon's log line."""
    deadline = time.monotonic() + timeout
    while daemon.metrics().get("freetoken_requests_in_flight", 0) > 0:
        if time.monotonic() > deadline:
            return  # the records will show what is missing
        time.sleep(0.2)
    time.sleep(0.5)  # the log line follows the in-flight count; the drain thread writes it


def read_records(path: Path, offset: int) -> list[dict[str, Any]]:
    """The daemon's JSON log lines (structlog, not a terminal) from byte ``offset`` on."""
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", "replace").splitlines()
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # uvicorn's plain-text warnings
        if isinstance(record, dict):
            records.append(record)
    return records


def json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def assert_served(run: Run, api: str, requests: int = 1) -> None:
    """The daemon answered the client's ``requests`` (or more) on ``api``, all with 200, and
    generated the answer to its end. (A client may abort a side request when it exits:
    OpenCode's session title, if the answer is done first.)"""
    problems = [r for r in run.records if r.get("event") in ("request rejected", "unhandled error")]
    assert not problems, "the daemon refused or failed requests:\n" + run.report()
    done = [r for r in run.records if r.get("event") == "request"]
    assert len(done) >= requests, "too few requests reached the daemon:\n" + run.report()
    for r in done:
        assert r["api"] == api and r["status"] == 200, run.report()
        assert r["stream"] is True, run.report()  # all three clients stream
    finished = [r for r in done if r["finish_reason"] in ("stop", "length", "tool_calls")]
    assert finished, "no request was generated to its end:\n" + run.report()


# --- Claude Code ---------------------------------------------------------------------------


def claude_env(daemon: Daemon, home: Path) -> dict[str, str]:
    """Claude Code's environment: offline, a fake key, every model alias the served one."""
    return {
        **base_env(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": daemon.url,
        "ANTHROPIC_API_KEY": "sk-ant-fake-key-for-freetoken",
        "ANTHROPIC_MODEL": SERVED,
        # the small/fast model (background tasks) and every tier alias: the one served model
        "ANTHROPIC_SMALL_FAST_MODEL": SERVED,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": SERVED,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": SERVED,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": SERVED,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_UPDATES": "1",
        "DISABLE_BUG_COMMAND": "1",
        "DISABLE_COST_WARNINGS": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
        "CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL": "1",
    }


def test_claude_code(daemon: Daemon, tmp_path: Path) -> None:
    exe = client("claude")
    env = claude_env(daemon, tmp_path / "home")
    # Timeouts are Claude Code's own: a stream silent for 5 minutes is dropped, and the daemon
    # pings while it prefills (checked by hand: a 330 s stall before the first token passed).
    argv = [str(exe), "-p", PROMPT, "--output-format", "stream-json", "--verbose"]
    run = run_client(daemon, argv, env, tmp_path / "work")
    assert run.code == 0, run.report()
    results = [e for e in json_lines(run.stdout) if e.get("type") == "result"]
    assert results, run.report()
    assert results[-1]["subtype"] == "success" and results[-1]["is_error"] is False, run.report()
    assert_served(run, "messages")


# --- Codex CLI -----------------------------------------------------------------------------

CODEX_CONFIG = """\
model = "{model}"
model_provider = "freetoken"
model_context_window = {context}
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.freetoken]
name = "freetoken"
base_url = "{url}/v1"
env_key = "FREETOKEN_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
trace_exporter = "none"
metrics_exporter = "none"
"""


def codex_env(daemon: Daemon, home: Path, sandbox: str = "read-only") -> dict[str, str]:
    """Codex's environment and its config.toml under ``home/.codex``."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    config = CODEX_CONFIG.format(model=SERVED, context=CONTEXT, url=daemon.url)
    config = config.replace('sandbox_mode = "read-only"', f'sandbox_mode = "{sandbox}"')
    (codex_home / "config.toml").write_text(config)
    return {
        **base_env(home),
        "CODEX_HOME": str(codex_home),
        "FREETOKEN_API_KEY": "sk-fake-key-for-freetoken",
    }


def test_codex(daemon: Daemon, tmp_path: Path) -> None:
    exe = client("codex")
    env = codex_env(daemon, tmp_path / "home")
    # --strict-config: a misspelt (say, telemetry) key fails the run instead of being ignored;
    # no retries, so a response Codex rejects fails the run instead of being resent. Its
    # 5-minute stream idle limit is the default: the daemon pings while it prefills.
    argv = [str(exe), "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral", "--json"]
    run = run_client(daemon, [*argv, PROMPT], env, tmp_path / "work")
    assert run.code == 0, run.report()
    kinds = [e.get("type") for e in json_lines(run.stdout)]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, run.report()
    assert_served(run, "responses")


# --- OpenCode ------------------------------------------------------------------------------


def opencode_config(url: str) -> dict[str, Any]:
    return {
        "autoupdate": False,
        "share": "disabled",
        "model": f"freetoken/{SERVED}",
        "small_model": f"freetoken/{SERVED}",  # the session-title request
        "enabled_providers": ["freetoken"],
        "provider": {
            "freetoken": {
                "npm": "@ai-sdk/openai-compatible",  # bundled in opencode: nothing fetched
                "name": "freetoken",
                "options": {"baseURL": f"{url}/v1", "apiKey": "sk-fake-key-for-freetoken"},
                "models": {
                    SERVED: {"name": SERVED, "limit": {"context": CONTEXT, "output": 32000}}
                },
            }
        },
    }


def opencode_env(daemon: Daemon, home: Path) -> dict[str, str]:
    """OpenCode's environment and its opencode.json in ``home``."""
    home.mkdir(parents=True)
    config = home / "opencode.json"
    config.write_text(json.dumps(opencode_config(daemon.url), indent=2))
    return {
        **base_env(home),
        "OPENCODE_CONFIG": str(config),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_CLAUDE_CODE": "1",
        "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
        "OPENCODE_DISABLE_EMBEDDED_WEB_UI": "1",
    }


def test_opencode(daemon: Daemon, tmp_path: Path) -> None:
    exe = client("opencode")
    env = opencode_env(daemon, tmp_path / "home")
    argv = [str(exe), "run", "--pure", "--print-logs", "--log-level", "WARN", "--format", "json"]
    run = run_client(daemon, [*argv, PROMPT], env, tmp_path / "work")
    assert run.code == 0, run.report()
    kinds = [e.get("type") for e in json_lines(run.stdout)]
    assert "step_finish" in kinds and "error" not in kinds, run.report()
    assert_served(run, "chat", requests=2)  # the session title, and the answer
