"""Run the daemon: load the model, build the app, serve it with uvicorn in this process.

SIGTERM (or a first Ctrl-C) starts a drain: new inference requests get 503, requests in
flight run to completion for up to ``drain_timeout`` seconds, then the server stops and the
process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from types import FrameType
from typing import Any

import structlog
import uvicorn

from ..config import DaemonConfig
from ..manager.control import ControlPlane
from ..native import dense_native
from .access import HttpAccess
from .app import create_app
from .state import ServerState

log = structlog.get_logger("freetokend")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._deadline = 0.0
        self._announce = False  # the drain started in handle_exit; on_tick logs it

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs in the main thread between two bytecodes of whatever it was
        # doing, e.g. inside the logger, holding the logger's lock: it only sets flags. Logging
        # here deadlocked the daemon when SIGTERM landed while a request was being logged;
        # on_tick announces the drain from the event loop.
        # Not calling super(): uvicorn would re-raise the signal after shutdown (exit 143).
        if self.state.draining:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        self._deadline = time.monotonic() + self.drain_timeout
        self._announce = True
        self.state.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self.state.draining:
            if self._announce:
                self._announce = False
                _hook(self.state, "on_draining")
                log.info(
                    "draining", in_flight=self.state.bridge.in_flight, timeout_s=self.drain_timeout
                )
            if self.state.bridge.in_flight == 0 or time.monotonic() > self._deadline:
                return True
        return await super().on_tick(counter)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                # stdout, flushed: scripts and tests read the bound port from this line
                print(
                    f"freetokend: serving {self.state.service.name} on http://{host}:{port}",
                    flush=True,
                )
                _hook(self.state, "on_listening", host, port)


def _hook(state: ServerState, name: str, *args: Any) -> None:
    """Control-plane callbacks (readiness, drain) registered in ``state.extra``."""
    fn = state.extra.get(name)
    if fn is not None:
        fn(*args)


def serve(cfg: DaemonConfig) -> int:

    # the loop's thread works between the engine's steps: the dense pool's workers do not spin
    # through them (dense_native.SPIN_US_* says what that measured)
    dense_native.cap_spin(dense_native.SPIN_US_SHARED)
    control: ControlPlane | None = None
    try:
        control = ControlPlane(cfg)
        state = control.start()
    except Exception as e:
        print(f"freetokend: {e}", file=sys.stderr)
        if control is not None:
            control.stop()
        return 1
    access = HttpAccess.from_config(cfg)
    if not access.key_digests and not access.check_host:
        log.warning(
            "the API listens beyond loopback without an API key: anyone who can reach "
            f"{cfg.host}:{cfg.port} can use it (set api_key)"
        )
    app = create_app(state, access)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        lifespan="on",
    )
    server = DrainingServer(config, state, cfg.drain_timeout)
    try:
        asyncio.run(server.serve())
    except KeyboardInterrupt:
        return 130
    finally:
        control.stop()
    if not server.started:
        print(f"freetokend: could not listen on {cfg.host}:{cfg.port}", file=sys.stderr)
        return 1
    return 0
