"""The systemd watchdog (issue 15): WATCHDOG=1 pings come from the event loop and only while the
engine thread is alive, so a stuck engine step stops them (and systemd restarts the daemon)
although HTTP still answers; the real daemon pings under WatchdogSec."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from freetokend.server import bridge as bridge_mod
from freetokend.server.bridge import EngineBridge
from freetokend.server.metrics import Metrics
from freetokend.server.watchdog import Watchdog, watchdog_seconds


def test_watchdog_seconds() -> None:
    assert watchdog_seconds({}) is None
    assert watchdog_seconds({"WATCHDOG_USEC": "120000000"}) == 120.0
    mine = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_seconds(mine) == 2.0
    assert watchdog_seconds({**mine, "WATCHDOG_PID": "1"}) is None  # meant for another process
    assert watchdog_seconds({"WATCHDOG_USEC": "junk"}) is None


def test_pings_only_while_the_engine_beats() -> None:
    now, beat, sent = [100.0], [100.0], []
    dog = Watchdog(1.0, 5.0, lambda: beat[0], lambda *a: sent.append(a) or True, lambda: now[0])
    assert dog.tick() and sent == [("WATCHDOG=1",)]
    now[0] = 104.9
    assert dog.tick()
    now[0] = 105.0  # no heartbeat for stale_s: stuck
    assert not dog.tick() and not dog.tick() and len(sent) == 2
    beat[0] = 105.0  # the step returned
    assert dog.tick() and len(sent) == 3
    assert Watchdog.for_timeout(120, lambda: 0.0).stale_s == 60


class StallingEngine:
    """Always has work; ``step`` blocks while ``free`` is clear (a hung kernel, a deadlock)."""

    def __init__(self) -> None:
        self.free = threading.Event()
        self.free.set()
        self.steps = 0

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list[Any]:
        self.free.wait()
        time.sleep(0.005)
        self.steps += 1
        return []

    def stats(self) -> None:
        return None

    def abort(self, request_id: str) -> None:
        pass


def test_a_stuck_engine_stops_the_pings_and_a_blocked_loop_sends_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real bridge and its engine thread, the watchdog task on a real event loop."""
    monkeypatch.setattr(bridge_mod, "IDLE_WAIT_S", 0.02)
    engine = StallingEngine()
    pings: list[float] = []

    async def main() -> dict[str, int]:
        bridge = EngineBridge(engine, 1, 0, Metrics())
        bridge.start(asyncio.get_running_loop())
        dog = Watchdog(0.02, 0.3, lambda: bridge.beat, lambda *a: pings.append(time.monotonic()))
        task = asyncio.ensure_future(dog.run())

        async def count(seconds: float) -> int:
            before = len(pings)
            await asyncio.sleep(seconds)
            return len(pings) - before

        async def pinged(n: int) -> int:
            """Waits (30 s at most, not a fixed window a loaded machine may not fill) for
            ``n`` more pings; the count seen."""
            before, deadline = len(pings), time.monotonic() + 30
            while len(pings) < before + n and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return len(pings) - before

        got = {"running": await pinged(5)}
        engine.free.clear()  # the engine thread is stuck inside step() from now on
        deadline = time.monotonic() + 30
        while dog.engine_alive() and time.monotonic() < deadline:  # > stale_s: stale heartbeat
            await asyncio.sleep(0.01)
        got["stuck"] = await count(0.4)
        engine.free.set()
        got["recovered"] = await pinged(5)
        before = len(pings)
        time.sleep(0.4)  # the event loop itself blocked (a deadlock on the loop thread)
        got["loop blocked"] = len(pings) - before
        task.cancel()
        bridge.stop()
        return got

    got = asyncio.run(main())
    assert got["running"] >= 5, got
    assert got["stuck"] == 0, got
    assert got["recovered"] >= 5, got
    assert got["loop blocked"] == 0, got
    assert engine.steps > 0


def test_the_daemon_pings_under_watchdogsec() -> None:
    """freetokend started as systemd would (NOTIFY_SOCKET, WATCHDOG_USEC): READY=1, then
    WATCHDOG=1 every WatchdogSec/4."""
    from server_support.daemon import _pythonpath, state_dir

    folder = Path(tempfile.mkdtemp(prefix="ftwd-", dir="/tmp"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(folder / "notify"))
    sock.settimeout(1.0)
    env = {
        **os.environ,
        "PYTHONPATH": _pythonpath(),
        "FREETOKEN_STATE_DIR": str(state_dir()),
        "NOTIFY_SOCKET": str(folder / "notify"),
        "WATCHDOG_USEC": "2000000",  # WatchdogSec=2: a ping every 0.5 s
    }
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "freetokend.cli", "--port", "0", "--admin-socket", "off"]
    log = open(folder / "log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
    got: list[str] = []
    pinged_at: list[float] = []  # when each WATCHDOG=1 arrived
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and got.count("WATCHDOG=1") < 6:
            try:
                message = sock.recv(4096).decode().split("\n")
            except TimeoutError:
                assert proc.poll() is None, "the daemon exited: " + (folder / "log").read_text()
                continue
            got.extend(message)
            pinged_at += [time.monotonic()] * message.count("WATCHDOG=1")
    finally:
        proc.terminate()
        proc.wait(30)
        log.seek(0)
        logged = log.read()
        log.close()
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)
    assert "READY=1" in got and got.count("WATCHDOG=1") >= 6, got
    assert got.index("READY=1") < got.index("WATCHDOG=1")
    # an idle engine must not pass for a stuck one: a withheld ping is logged (not timed here,
    # which a loaded machine's scheduling would blur)
    assert "engine thread stuck" not in logged, logged[-2000:]
    # a ping every 0.5 s (WatchdogSec/4), not one per WatchdogSec: the median gap, which a
    # loaded machine's occasional late wake-up does not move
    gaps = sorted(b - a for a, b in zip(pinged_at, pinged_at[1:], strict=False))
    assert gaps[len(gaps) // 2] < 1.0, f"pings {gaps} s apart, not every 0.5 s"


def test_a_ping_that_cannot_be_sent_does_not_stop_the_watchdog(tmp_path: Path) -> None:
    """systemd not reading (a full notify queue): the ping fails fast, the loop goes on."""
    from freetokend.runtime.sdnotify import notify

    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as reader:
        reader.bind(str(path))
        env = {"NOTIFY_SOCKET": str(path)}
        dog = Watchdog(1.0, 5.0, time.monotonic, lambda *a: notify(*a, env=env))
        started = time.monotonic()
        results = [dog.tick() for _ in range(2000)]  # far more than the queue holds
        assert time.monotonic() - started < 10
        assert results[0] and not results[-1]  # the first went through, later ones dropped
        assert reader.recv(64) == b"WATCHDOG=1"


def test_a_slow_idle_spill_keeps_the_heartbeat_fresh(
    builtin_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The idle spill runs on the engine thread and can outlast the watchdog's stale time (many
    snapshots, a slow disk); each file written is progress (runtime/heartbeat.py), so a busy
    engine is not taken for a stuck one. Before the fix the heartbeat aged through the whole
    spill: here ~0.3 s per file, 0.6 s stale time, several files."""
    import torch

    import freetokend.kv.spill as spill_mod
    from freetokend import LLM
    from freetokend.engine.sampler import SamplingParams

    per_file, stale = 0.3, 0.6
    monkeypatch.setattr(bridge_mod, "IDLE_WAIT_S", 0.02)
    real_write = spill_mod.SnapshotSpill._write
    written: list[float] = []
    beat_before: list[float] = []  # the engine's heartbeat as each file's write began
    holder: dict[str, EngineBridge] = {}

    def slow_write(self: Any, *args: Any) -> int:
        beat_before.append(holder["bridge"].beat)
        time.sleep(per_file)  # a slow disk
        size = real_write(self, *args)
        written.append(time.monotonic())
        return size

    monkeypatch.setattr(spill_mod.SnapshotSpill, "_write", slow_write)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(builtin_model_dir, state_dir=tmp_path, max_model_len=1024, kv_tokens=4096)
    try:
        core = llm.engine
        prefix = core.prefix
        assert prefix is not None
        for i in range(2):  # two short sessions: their snapshots are protected, to spill
            msgs = [{"role": "user", "content": f"task {i}: " + "alpha beta gamma " * 10}]
            ids = llm.tokenizer.encode(llm.chat_template.render(msgs, add_generation_prompt=True))
            core.add_request(f"r{i}", ids, SamplingParams(max_tokens=3, ignore_eos=True))
            while core.has_unfinished():
                core.step()
        assert prefix.unspilled()
        core.spill_idle_s = 0.0  # the next idle wake-up spills
        bridge = holder["bridge"] = EngineBridge(core, 1, 0, Metrics())
        loop = asyncio.new_event_loop()
        started = time.monotonic()
        bridge.start(loop)
        try:
            deadline = started + 60
            while not (written and not prefix.unspilled()) and time.monotonic() < deadline:
                time.sleep(0.005)
        finally:
            bridge.stop()
            loop.close()
    finally:
        llm.close()
        torch.set_num_threads(threads)
    took = written[-1] - started if written else 0.0
    assert len(written) >= 3 and took > stale, (len(written), took)  # the spill outlasts it
    # each file written refreshed the heartbeat before the next began, so the watchdog saw
    # it at most one file old (asserted by order, not by a wall-clock bound: a loaded machine
    # slows every file alike)
    stale_at = [i for i in range(1, len(written)) if beat_before[i] < written[i - 1]]
    assert not stale_at, f"no heartbeat between files {stale_at} and the ones before them"


def test_the_bandwidth_bench_and_parking_beat_per_unit(
    builtin_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench (run at a safe point: the engine thread waits on it) beats per copy
    iteration and after the decode pass; moving dense weights beats per module."""
    from freetokend import LLM
    from freetokend.engine import placement
    from freetokend.experts.accelerator import StandinAccelerator
    from freetokend.experts.bandwidth import measure
    from freetokend.runtime import heartbeat

    beats: list[float] = []
    monkeypatch.setattr(heartbeat, "beat", lambda: beats.append(time.monotonic()))
    llm = LLM(builtin_model_dir, max_model_len=256, kv_tokens=1024)
    try:
        measure(llm.banks, StandinAccelerator(), llm.moe, top_k=llm.config.top_k)
        assert len(beats) >= 3 + 1  # three timed copy runs, one decode pass
        beats.clear()
        placement._move(llm.model, next(llm.model.parameters()).device)
        assert len(beats) == len(list(llm.model.modules()))
    finally:
        llm.close()
