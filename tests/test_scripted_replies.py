"""The test-only scripted-reply mode (server/scripted.py; issue 46 item 1).

Refused unless enabled, absent from the daemon's flags; with it, each chat request's reply is
the script's, keyed on the latest user/tool input, produced token by token by the built-in
model under a one-token mask, and read back by the real parsers of each API: content, thinking
and tool calls in the built-in model's syntax (ChatML, ``<think>``, ``<tool_call>`` JSON). The
reply's tokens are those the next request's prompt has there, and the next request reports the
previous prompt as cached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from litestar.testing import TestClient
from server_support.daemon import REPO, _pythonpath, quiet_control_plane, state_dir

from freetokend.cli import build_parser
from freetokend.server import scripted
from freetokend.server.app import create_app
from freetokend.server.errors import InvalidRequest
from freetokend.server.scripted import (
    ENV_MODE,
    ENV_SCRIPT,
    MODE,
    Script,
    ScriptedConstraint,
    ScriptError,
    conversation_key,
)

MODEL = "builtin-qwen35moe-tiny"

# --- refused unless enabled -----------------------------------------------------------------


def test_off_by_default() -> None:
    assert scripted.from_env({}) is None


def test_a_script_without_the_mode_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"replies": []}))
    for mode in ("", "1", "scripted"):
        with pytest.raises(ScriptError, match="test-only"):
            scripted.from_env({ENV_SCRIPT: str(path), ENV_MODE: mode})
    with pytest.raises(ScriptError, match=ENV_SCRIPT):
        scripted.from_env({ENV_MODE: MODE})
    assert scripted.from_env({ENV_SCRIPT: str(path), ENV_MODE: MODE}) is not None


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ("[]", "JSON object"),
        ("{", "cannot read"),
        ({"replies": [{"reply": {}}]}, "match"),
        ({"replies": [{"match": "a", "reply": {"text": "x"}}]}, "unknown reply keys"),
        ({"replies": [{"match": "a", "reply": {"tool_calls": [{"arguments": {}}]}}]}, "name"),
        ({"replies": [{"match": "a", "tools": "yes", "reply": {}}]}, "true or false"),
    ],
)
def test_a_bad_script_fails_the_start(tmp_path: Path, raw: Any, needle: str) -> None:
    path = tmp_path / "s.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    with pytest.raises(ScriptError, match=needle):
        scripted.from_env({ENV_SCRIPT: str(path), ENV_MODE: MODE})


def test_the_daemon_refuses_to_start(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"replies": []}))
    env = {
        **os.environ,
        "PYTHONPATH": _pythonpath(),
        "FREETOKEN_STATE_DIR": str(state_dir()),
        ENV_SCRIPT: str(path),
    }
    env.pop(ENV_MODE, None)
    cmd = [sys.executable, "-m", "freetokend.cli", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "test-only" in proc.stderr and "serving" not in proc.stdout


def test_not_a_flag_nor_a_setting() -> None:
    text = build_parser().format_help().lower()
    assert "script" not in text and "test_mode" not in text and "test-mode" not in text


# --- keys and the constraint ----------------------------------------------------------------


def test_the_key_is_the_input_after_the_last_assistant_message() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "sys ALPHA"},
        {"role": "user", "content": "first BETA"},
    ]
    assert conversation_key(msgs) == "first BETA"  # the system prompt is not part of it
    msgs += [
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": [{"type": "text", "text": "out GAMMA"}]},
        {"role": "user", "content": "reminder DELTA"},
    ]
    assert conversation_key(msgs) == "out GAMMA\nreminder DELTA"


def test_entries_in_order_then_the_default(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(
        json.dumps(
            {
                "replies": [
                    {"match": "x", "system": "title", "reply": {"content": "T"}},
                    {"match": "x", "tools": True, "reply": {"content": "A"}},
                    {"match": "", "reply": {"content": "B"}},
                ]
            }
        )
    )
    s = Script(path)
    user = [{"role": "user", "content": "x"}]
    title = [{"role": "system", "content": "You write a title"}, *user]
    assert s.choose(title, True) == (0, {"content": "T"})
    assert s.choose(user, True) == (1, {"content": "A"})
    assert s.choose(user, False) == (2, {"content": "B"})
    path.write_text(json.dumps({"replies": [], "default": {"content": "D"}}))
    assert s.choose(user, True) == (-1, {"content": "D"})  # re-read when the file changes
    path.write_text(json.dumps({"replies": []}))
    with pytest.raises(InvalidRequest, match="no entry matches"):
        s.choose(user, True)


def test_the_constraint_allows_one_token_at_a_time() -> None:
    c = ScriptedConstraint([3, 1, 2])
    for want in (3, 1, 2):
        assert not c.is_terminated()
        with torch.inference_mode():
            logits = torch.randn(8)
        c.fill_mask(logits)
        assert int(torch.argmax(logits)) == want
        assert torch.isinf(logits).sum() == 7
        c.accept(want)
    assert c.is_terminated()
    bad = ScriptedConstraint([3, 1])
    bad.accept(4)
    assert bad.is_terminated()


# --- through the real model and the three APIs ----------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string"} for k in keys},
                "required": keys,
            },
        },
    }
    for name, keys in (("read", ["path"]), ("bash", ["command"]))
]
READ_CALL = {"name": "read", "arguments": {"path": "src/app.py"}}
SCRIPT = {
    "replies": [
        {
            "match": "Fix the bug",
            "reply": {"reasoning": "I should read the file first.", "tool_calls": [READ_CALL]},
        },
        {
            "match": "def main",
            "reply": {
                "content": "Running the tests.",
                "tool_calls": [
                    {"name": "bash", "arguments": {"command": "pytest -q"}},
                    {"name": "read", "arguments": {"path": "README.md"}},
                ],
            },
        },
        {"match": "1 passed", "reply": {"content": "Fixed: all tests pass."}},
    ],
}


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient[Any], Path]]:
    folder = tmp_path_factory.mktemp("scripted")
    transcript = folder / "transcript.jsonl"
    (folder / "script.json").write_text(json.dumps({**SCRIPT, "transcript": str(transcript)}))
    mp = pytest.MonkeyPatch()
    mp.setenv(ENV_SCRIPT, str(folder / "script.json"))
    mp.setenv(ENV_MODE, MODE)
    control = quiet_control_plane()
    mp.undo()
    state = control.start()
    try:
        with TestClient(create_app(state)) as tc:
            yield tc, transcript
    finally:
        control.stop()


def records(transcript: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in transcript.read_text().splitlines()]


def post(tc: TestClient[Any], path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = tc.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_chat_completions_session(session: tuple[TestClient[Any], Path]) -> None:
    tc, transcript = session
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the bug in src/app.py"},
    ]
    first = post(tc, "/v1/chat/completions", {"messages": msgs, "tools": TOOLS})
    m = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    assert m["reasoning_content"] == "I should read the file first."
    assert not m["content"]
    [call] = m["tool_calls"]
    assert call["function"]["name"] == "read"
    assert json.loads(call["function"]["arguments"]) == {"path": "src/app.py"}
    # the client sends the call back (OpenCode and Codex do not send reasoning back)
    msgs += [
        {"role": "assistant", "content": "", "tool_calls": m["tool_calls"]},
        {"role": "tool", "tool_call_id": call["id"], "content": "def main():\n    pass"},
    ]
    second = post(tc, "/v1/chat/completions", {"messages": msgs, "tools": TOOLS})
    m2 = second["choices"][0]["message"]
    assert m2["content"] == "Running the tests."
    assert [c["function"]["name"] for c in m2["tool_calls"]] == ["bash", "read"]
    assert json.loads(m2["tool_calls"][0]["function"]["arguments"]) == {"command": "pytest -q"}
    # sent back as received: it renders to the reply's tokens
    msgs += [
        {"role": "assistant", "content": m2["content"], "tool_calls": m2["tool_calls"]},
        *(
            {"role": "tool", "tool_call_id": c["id"], "content": out}
            for c, out in zip(m2["tool_calls"], ["1 passed", "# app"], strict=True)
        ),
    ]
    third = post(tc, "/v1/chat/completions", {"messages": msgs, "tools": TOOLS})
    assert third["choices"][0]["message"]["content"] == "Fixed: all tests pass."
    assert third["choices"][0]["finish_reason"] == "stop"

    r1, r2, r3 = records(transcript)[-3:]
    assert [r["entry"] for r in (r1, r2, r3)] == [0, 1, 2]
    # the reply's tokens are the next prompt's there (the last of them: the stop token)
    assert r3["prompt_ids"][: len(r2["prompt_ids"]) + len(r2["reply_ids"])] == (
        r2["prompt_ids"] + r2["reply_ids"]
    )
    assert r2["prompt_ids"][: len(r1["prompt_ids"])] == r1["prompt_ids"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(r1["prompt_ids"])
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(r2["prompt_ids"])
    assert first["usage"]["completion_tokens"] == len(r1["reply_ids"])


def test_chat_completions_stream(session: tuple[TestClient[Any], Path]) -> None:
    tc, _ = session
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Fix the bug, streaming"}],
        "tools": TOOLS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with tc.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert reasoning == "I should read the file first."
    assert calls[0]["function"]["name"] == "read"
    args = "".join(c["function"].get("arguments") or "" for c in calls)
    assert json.loads(args) == {"path": "src/app.py"}
    assert events[-1]["usage"]["completion_tokens"] > 0


def test_anthropic_messages_session(session: tuple[TestClient[Any], Path]) -> None:
    tc, transcript = session
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Fix the bug (Anthropic)"}]
    body = {"system": "You are Claude Code.", "tools": tools, "max_tokens": 400}
    first = post(tc, "/v1/messages", {**body, "messages": msgs})
    kinds = [b["type"] for b in first["content"]]
    assert kinds == ["thinking", "tool_use"], first
    assert first["content"][0]["thinking"] == "I should read the file first."
    use = first["content"][1]
    assert use["name"] == "read" and use["input"] == {"path": "src/app.py"}
    assert first["stop_reason"] == "tool_use"
    msgs += [
        {"role": "assistant", "content": first["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "def main"}],
        },
    ]
    second = post(tc, "/v1/messages", {**body, "messages": msgs})
    assert [b["type"] for b in second["content"]] == ["text", "tool_use", "tool_use"]
    assert second["content"][0]["text"] == "Running the tests."
    assert second["usage"]["cache_read_input_tokens"] >= first["usage"]["input_tokens"]
    # the thinking block and the call, sent back as received, render to the reply's tokens
    r1, r2 = records(transcript)[-2:]
    assert r2["prompt_ids"][: len(r1["prompt_ids"]) + len(r1["reply_ids"])] == (
        r1["prompt_ids"] + r1["reply_ids"]
    )


def test_responses_session(session: tuple[TestClient[Any], Path]) -> None:
    tc, _ = session
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": "Fix the bug (Responses)"}
    ]
    first = post(tc, "/v1/responses", {"input": items, "tools": tools})
    kinds = [o["type"] for o in first["output"]]
    assert kinds == ["reasoning", "function_call"], first
    call = first["output"][1]
    assert call["name"] == "read" and json.loads(call["arguments"]) == {"path": "src/app.py"}
    items += [
        call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "def main"},
    ]
    second = post(tc, "/v1/responses", {"input": items, "tools": tools})
    calls = [o["name"] for o in second["output"] if o["type"] == "function_call"]
    assert calls == ["bash", "read"]
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["input_tokens"]


def test_no_match_is_refused(session: tuple[TestClient[Any], Path]) -> None:
    tc, _ = session
    r = tc.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "unscripted"}]},
    )
    assert r.status_code == 400 and "no entry matches" in r.text
