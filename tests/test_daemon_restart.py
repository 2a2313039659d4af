"""A daemon restarted in the middle of an agent session resumes it: the next turn re-prefills
only the suffix after the last prompt the old daemon saw (ARCHITECTURE §5.4, snapshot spill).

Two ways a daemon goes away: SIGTERM (the drain writes the session snapshots on the way out)
and SIGKILL after an idle moment (the engine wrote them when it went idle; nothing written at
exit). The built-in hybrid model, so each resume needs both the recurrent state and the KV.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from agent_sessions import TOOLS, make_session
from server_support.daemon import Daemon, start_daemon

TURNS = 5
NAME = "restart-test"


def _start(model: Path, state: Path, idle_s: float) -> Daemon:
    return start_daemon(
        "--model", str(model), "--served-model-name", NAME, "--state-dir", str(state), "--admin-socket", "off",
        "--spill-idle-s", str(idle_s),
    )  # fmt: skip


def _turn(d: Daemon, messages: list[dict[str, Any]]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of one greedy chat turn."""
    body = {"model": NAME, "messages": messages, "tools": TOOLS,
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    status, out = d.post("/v1/chat/completions", body)
    assert status == 200, out
    usage = out["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def _spilled(state: Path) -> set[Path]:
    return set((state / "snapshots").rglob("*.safetensors"))


def _spill_logged(d: Daemon) -> bool:
    return any("spilled" in line and "session snapshot" in line for line in list(d.log))


def test_restart_mid_session_reprefills_only_the_suffix(
    builtin_model_dir: Path, tmp_path: Path
) -> None:
    session = make_session("opencode", TURNS, seed=7, output_lines=4, every=10)  # appends only
    state = tmp_path / "state"

    # A serves turns 0-2 and is stopped with SIGTERM: the drain writes the snapshots.
    a = _start(builtin_model_dir, state, idle_s=3600)  # no idle spill: only the exit writes
    seen = [_turn(a, session.messages(t)) for t in range(3)]
    assert seen[1][1] > 0 and seen[2][1] > 0  # one daemon: later turns reuse earlier ones
    assert not _spilled(state)
    assert a.stop(signal.SIGTERM) == 0
    assert _spilled(state)

    # B: the first turn after the restart resumes where A's last prompt ended.
    b = _start(builtin_model_dir, state, idle_s=0.2)
    # taken before the turn: B's idle spill may land 0.2 s after it, before a loaded machine
    # got back to this test (B has nothing of its own to spill before the turn)
    before = _spilled(state)
    prompt, cached = _turn(b, session.messages(3))
    assert cached == seen[2][0], (prompt, cached, seen)
    assert prompt - cached < prompt // 4  # the new suffix only, not the whole session
    # B goes idle, writes turn 3's snapshots, and is then killed: nothing is written at exit.
    # (Wait for the log line that ends the spill, not for a first file: a kill between files is
    # a different test, tests/test_prefix_reuse.py, crash-before-rows.)
    deadline = time.monotonic() + 60
    while not _spill_logged(b) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _spill_logged(b), "the idle engine wrote no snapshot"
    assert _spilled(state) != before
    b.stop(signal.SIGKILL)

    c = _start(builtin_model_dir, state, idle_s=3600)
    try:
        prompt4, cached4 = _turn(c, session.messages(4))
        assert cached4 == prompt, (prompt4, cached4, prompt)
    finally:
        c.stop()
