"""Scripted replies: a TEST-ONLY mode in which a script, not the model, chooses each chat reply.

Random-weight models cannot drive a coding agent's tool loop. In this mode each chat request's
completion is the script's reply for the conversation (keyed on its latest input: the user and
tool messages after the last assistant message), and the engine is held to exactly the tokens
of that reply by a :class:`ScriptedConstraint`: the same per-step mask the forced-call grammars
use, so the real model runs every step, the sampler picks under the mask, and the text goes
through the real detokenizer, output parser, streaming and usage as in serving.

A reply is written as an assistant message (``reasoning``, ``content``, ``tool_calls``) and
rendered by the model's own chat template, so it is spelled in the model's own syntax and
exactly as the template renders that message in the next request (its tokens are the next
prompt's tokens: prefix reuse sees what it would see in serving).

Not a serving option: it is not a :class:`~freetokend.config.DaemonConfig` setting (no flag,
no config key, nothing in ``--help``). It is read from the environment only, and only when a
second variable enables it; the script alone makes the daemon refuse to start::

    FREETOKEN_TEST_MODE=scripted-replies FREETOKEN_TEST_SCRIPT=/path/script.json freetokend

The script is a JSON object, re-read whenever the file changes (a test may swap scripts between
sessions without restarting the daemon)::

    {
      "replies": [
        {"match": "text in the latest input",    # required; "" matches anything
         "system": "text in the system prompt",  # optional
         "tools": true,                          # optional: the request has tools (or not)
         "reply": {"reasoning": "...", "content": "...",
                   "tool_calls": [{"name": "Read", "arguments": {"file_path": "a.py"}}]}}
      ],
      "default": {"content": "..."},             # optional: when no entry matches
      "transcript": "/path/transcript.jsonl"     # optional: one line per request (below)
    }

Entries are tried in order; the first that matches gives the reply. No match and no default:
the request is refused (400) with the key it had. The transcript line of a request holds its
request id (the daemon log's ``request_id``), the entry chosen (index, or -1 for the default),
the prompt's token ids and the reply's: what a test needs to measure prefix reuse.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .chat import assistant_tool_call
from .errors import InvalidRequest

ENV_SCRIPT = "FREETOKEN_TEST_SCRIPT"
ENV_MODE = "FREETOKEN_TEST_MODE"
MODE = "scripted-replies"


class ScriptError(ValueError):
    """The scripted mode is misconfigured (refused at start) or the script is invalid."""


@dataclass(frozen=True)
class Entry:
    match: str
    reply: dict[str, Any]
    system: str | None = None
    tools: bool | None = None

    def matches(self, key: str, system: str, has_tools: bool) -> bool:
        if self.tools is not None and self.tools != has_tools:
            return False
        if self.system is not None and self.system not in system:
            return False
        return self.match in key


def from_env(env: Mapping[str, str] | None = None) -> Script | None:
    """The script the environment names, or None. A script without the enabling variable (or
    the variable with a wrong value) is refused: the daemon does not start."""
    env = os.environ if env is None else env
    path = env.get(ENV_SCRIPT, "")
    mode = env.get(ENV_MODE, "")
    if not path:
        if mode == MODE:
            raise ScriptError(f"{ENV_MODE}={MODE} needs {ENV_SCRIPT} (the script's path)")
        return None
    if mode != MODE:
        raise ScriptError(
            f"{ENV_SCRIPT} is a test-only setting (scripted replies instead of the model's); "
            f"it is refused unless {ENV_MODE}={MODE} is set too"
        )
    script = Script(Path(path))
    script.load()  # a bad script fails the start, not the first request
    return script


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return ""


def conversation_key(messages: list[dict[str, Any]]) -> str:
    """The latest input: the text of the user and tool messages after the last assistant
    message (the whole conversation's, on its first turn), system messages left out."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    tail = messages[last + 1 :]
    return "\n".join(_text(m.get("content")) for m in tail if m.get("role") in ("user", "tool"))


def system_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(_text(m.get("content")) for m in messages if m.get("role") == "system")


def _reply(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ScriptError(f"{where}: a reply is an object (reasoning, content, tool_calls)")
    unknown = set(value) - {"reasoning", "content", "tool_calls"}
    if unknown:
        raise ScriptError(f"{where}: unknown reply keys {sorted(unknown)}")
    for name in ("reasoning", "content"):
        if name in value and not isinstance(value[name], str):
            raise ScriptError(f"{where}.{name}: must be a string")
    calls = value.get("tool_calls", [])
    if not isinstance(calls, list):
        raise ScriptError(f"{where}.tool_calls: must be a list")
    for j, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ScriptError(f"{where}.tool_calls[{j}]: needs a name")
        if not isinstance(call.get("arguments", {}), dict):
            raise ScriptError(f"{where}.tool_calls[{j}].arguments: must be an object")
    return value


def parse_script(raw: Any) -> tuple[list[Entry], dict[str, Any] | None, Path | None]:
    if not isinstance(raw, dict):
        raise ScriptError("the script is a JSON object with a 'replies' list")
    entries = []
    for i, item in enumerate(raw.get("replies", [])):
        where = f"replies[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("match"), str):
            raise ScriptError(f"{where}: needs a 'match' string")
        tools = item.get("tools")
        if tools is not None and not isinstance(tools, bool):
            raise ScriptError(f"{where}.tools: must be true or false")
        system = item.get("system")
        if system is not None and not isinstance(system, str):
            raise ScriptError(f"{where}.system: must be a string")
        entries.append(Entry(item["match"], _reply(item.get("reply"), where), system, tools))
    default = raw.get("default")
    if default is not None:
        default = _reply(default, "default")
    transcript = raw.get("transcript")
    return entries, default, Path(transcript) if isinstance(transcript, str) else None


class Script:
    """The script file, re-read when it changes; safe to use from several worker threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self.entries: list[Entry] = []
        self.default: dict[str, Any] | None = None
        self.transcript: Path | None = None
        self._lock = threading.Lock()

    def load(self) -> None:
        with self._lock:
            try:
                st = self.path.stat()
                stamp = (st.st_mtime_ns, st.st_size)
                if stamp == self._stamp:
                    return
                raw = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ScriptError(f"{ENV_SCRIPT}: cannot read {self.path} ({e})") from None
            self.entries, self.default, self.transcript = parse_script(raw)
            self._stamp = stamp

    def choose(self, messages: list[dict[str, Any]], has_tools: bool) -> tuple[int, dict[str, Any]]:
        """(entry index or -1 for the default, reply) for this conversation."""
        self.load()
        key = conversation_key(messages)
        system = system_text(messages)
        for i, entry in enumerate(self.entries):
            if entry.matches(key, system, has_tools):
                return i, entry.reply
        if self.default is not None:
            return -1, self.default
        raise InvalidRequest(
            f"scripted replies: no entry matches this conversation ({key[-300:]!r})"
        )

    def record(self, line: dict[str, Any]) -> None:
        if self.transcript is None:
            return
        with self._lock, open(self.transcript, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def assistant_message(reply: dict[str, Any], with_reasoning: bool = True) -> dict[str, Any]:
    """The reply as the template-ready assistant message a client would send back."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.get("content", "")}
    if with_reasoning and reply.get("reasoning"):
        msg["reasoning_content"] = reply["reasoning"]
    calls = reply.get("tool_calls") or []
    if calls:
        msg["tool_calls"] = [
            assistant_tool_call(f"call_{i}", c["name"], c.get("arguments", {}))
            for i, c in enumerate(calls)
        ]
    return msg


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ScriptedConstraint:
    """Allows exactly one token per step: ``ids`` in order (the last one a stop token). Implements
    the engine's ``Constraint`` protocol, like the grammar constraints."""

    def __init__(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("a scripted reply needs at least one token")
        self.ids = list(ids)
        self.entry = -1  # the script entry it came from (-1: the default reply)
        self._pos = 0
        self._dead = False

    def fill_mask(self, logits: torch.Tensor) -> None:
        # past the end only after a stop the engine did not end on: hold the last id
        want = self.ids[min(self._pos, len(self.ids) - 1)]
        with torch.inference_mode():  # the engine's logits are inference tensors
            logits.fill_(float("-inf"))
            logits[want] = 0.0

    def accept(self, token_id: int) -> None:
        if self._pos >= len(self.ids) or token_id != self.ids[self._pos]:
            self._dead = True  # a masked token was picked (should not happen): stop
        self._pos += 1

    def is_terminated(self) -> bool:
        return self._dead or self._pos >= len(self.ids)
