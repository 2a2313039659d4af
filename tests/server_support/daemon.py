"""Start the real ``freetokend`` process on a free loopback port, with the built-in model.

The process is the console script's code (``python -m freetokend.cli``) with ``--port 0``; the
bound port is read from its "serving ... on http://HOST:PORT" line. One shared daemon serves
most tests (started on first use, stopped at exit); tests that need special settings or kill
the process start their own.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from freetokend.manager.control import ControlPlane

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "builtin-qwen35moe-tiny"
# Per-request client timeout: generous, because a 2-core machine shared with other jobs can
# run the tiny model 10x slower than when idle; a hung daemon still fails the test.
CLIENT_TIMEOUT = 300.0
_LISTEN = re.compile(r"serving (\S+) on (http://\S+)")


def _pythonpath() -> str:
    """freetokend importable from THIS checkout without installing: a symlink farm (import
    name -> folder) private to this checkout, first on the daemon's PYTHONPATH."""
    tag = hashlib.sha1(str(REPO).encode()).hexdigest()[:10]
    farm = Path(tempfile.gettempdir()) / f"ftpath-{tag}"
    farm.mkdir(exist_ok=True)
    for name, folder in (("freetokend", "daemon"), ("ftctl", "ctl"), ("ftkernels", "kernels")):
        link = farm / name
        if not link.exists():
            try:
                link.symlink_to(REPO / folder)
            except FileExistsError:
                pass
    return os.pathsep.join(p for p in (str(farm), os.environ.get("PYTHONPATH", "")) if p)


def state_dir() -> Path:
    """One state folder per test session, so the built-in model is generated once."""
    path = Path(
        os.environ.get("FT_TEST_STATE_DIR") or Path(tempfile.gettempdir()) / "ft-server-tests"
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    url: str = ""
    model: str = MODEL_NAME
    log: list[str] = field(default_factory=list)
    log_path: Path | None = None  # the whole stderr+stdout of the process

    def get(self, path: str, timeout: float = 60) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(
        self,
        path: str,
        body: bytes | dict,
        headers: dict | None = None,
        timeout: float = CLIENT_TIMEOUT,
    ) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"content-type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"raw": raw.decode("utf-8", "replace")}
        except TimeoutError as e:
            raise TimeoutError(f"POST {path} timed out; {self.stacks()}") from e

    def stacks(self) -> str:
        """The daemon's thread stacks (SIGUSR1: faulthandler) and its last log lines, for a
        failure message when it stops answering."""
        if self.proc.poll() is not None:
            return f"the daemon exited ({self.proc.returncode}):\n" + "".join(self.log[-40:])
        before = len(self.log)
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        return "its stacks and last log lines:\n" + "".join(self.log[max(0, before - 20) :])

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics as name -> value."""
        _, text = self.get("/metrics")
        out = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_daemon(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> Daemon:
    """Start a daemon with extra CLI ``args`` (and ``env`` added to the environment); returns
    once it listens."""
    env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": _pythonpath(),
        "FREETOKEN_STATE_DIR": str(state_dir()),
    }
    cmd = [sys.executable, "-m", "freetokend.cli", "--host", "127.0.0.1", "--port", "0", *args]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    daemon = Daemon(proc)
    logs = state_dir() / "logs"
    logs.mkdir(exist_ok=True)
    daemon.log_path = logs / f"daemon-{proc.pid}.log"
    threading.Thread(
        target=_drain, args=(proc.stderr, daemon.log, daemon.log_path), daemon=True
    ).start()
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        daemon.log.append(line)
        m = _LISTEN.search(line)
        if m:
            daemon.model, daemon.url = m.group(1), m.group(2)
            break
        if time.monotonic() > deadline:
            break
    if not daemon.url:
        daemon.stop(signal.SIGKILL)
        raise RuntimeError("the daemon did not start:\n" + "".join(daemon.log[-40:]))
    threading.Thread(
        target=_drain, args=(proc.stdout, daemon.log, daemon.log_path), daemon=True
    ).start()
    return daemon


def _drain(stream, sink: list[str], path: Path | None = None) -> None:  # type: ignore[no-untyped-def]
    """Keep the output's tail in memory and all of it in ``path`` (for failure reports)."""
    with open(path or os.devnull, "a", encoding="utf-8") as f:
        for line in stream:
            f.write(line)
            f.flush()
            sink.append(line)
            del sink[:-500]


_shared: Daemon | None = None
_lock = threading.Lock()


def shared_daemon() -> Daemon:
    """The daemon most tests share (default settings), started once per test process."""
    global _shared
    with _lock:
        if _shared is None or _shared.proc.poll() is not None:
            _shared = start_daemon()
            atexit.register(_shared.stop)
        return _shared


def quiet_control_plane() -> ControlPlane:
    """The daemon's control plane as ``serve()`` builds it, in this process, without its admin
    socket, VRAM watcher or session spills into the shared state folder; not started."""
    from freetokend.config import resolve
    from freetokend.manager.control import ControlPlane  # noqa: F811 (at run time)

    cli = {
        "state_dir": str(state_dir()),
        "admin_socket": "off",
        "vram_watch": False,
        "spill_budget_mb": 0,
    }
    return ControlPlane(resolve(cli, None, env={}))
