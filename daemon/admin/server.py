"""AdminServer: the grpc.aio Admin service behind the credential gate, on its own thread.

The admin API runs on a thread with its own event loop, apart from the HTTP server's loop, so
a slow admin call (a model load) never delays inference traffic and the HTTP server needs no
change to host it. The gRPC server listens on a socket inside a private folder next to the
public socket (see ``gate``); the folder is removed on stop.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import grpc

from . import admin_pb2_grpc as pb_grpc
from .gate import CredentialGate
from .paths import prepare_dir
from .service import AdminService, Ops

log = logging.getLogger(__name__)


class AdminServer:
    def __init__(self, ops: Ops, path: Path) -> None:
        self.ops = ops
        self.path = path
        self.gate: CredentialGate | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Listen on ``path``; raises what kept the server from starting (e.g. SocketBusy)."""
        self._thread = threading.Thread(target=self._run, name="admin", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the admin server did not start")
        if self._error is not None:
            raise self._error

    def stop(self, timeout: float = 5.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported to start()
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        prepare_dir(self.path)
        _remove_dead_private_dirs(self.path.parent)
        private = Path(tempfile.mkdtemp(prefix=".admin-", dir=self.path.parent))
        server = grpc.aio.server()
        pb_grpc.add_AdminServicer_to_server(AdminService(self.ops), server)
        try:
            server.add_insecure_port(f"unix:{private / 'grpc.sock'}")
            await server.start()
            self.gate = CredentialGate(self.path, private / "grpc.sock")
            await self.gate.start()
            log.info("admin API on %s", self.path)
            self._ready.set()
            await self._stop.wait()
        finally:
            if self.gate is not None:
                await self.gate.close()
            await server.stop(grace=1.0)
            shutil.rmtree(private, ignore_errors=True)


def _remove_dead_private_dirs(folder: Path) -> None:
    """Private gRPC folders left by daemons that were killed (nothing listens there any more)."""
    for d in folder.glob(".admin-*"):
        sock = d / "grpc.sock"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(sock))
            continue  # a live daemon's
        except OSError:
            shutil.rmtree(d, ignore_errors=True)
