"""The admin socket's front door: checks each caller's credentials, then relays to gRPC.

gRPC's Python server does not expose the peer credentials of a unix-socket connection, so the
public socket (mode 0660) is ours: every accepted connection is checked with SO_PEERCRED
(``AccessPolicy``); an allowed one is relayed byte for byte to the gRPC server, which listens
on a socket inside a private 0700 folder that only the daemon's user can reach; a refused one
is closed at once (the client sees the connection drop; the daemon logs who was refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path

from .peercred import AccessPolicy

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660
_CHUNK = 1 << 16


class SocketBusy(RuntimeError):
    """Another live process listens on the admin socket path."""


def claim_path(path: Path) -> None:
    """Remove a stale socket left by a dead daemon; refuse a live one or a non-socket file."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_socket():
        raise SocketBusy(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
            return
    raise SocketBusy(f"another daemon listens on {path}")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


class CredentialGate:
    def __init__(self, public: Path, upstream: Path) -> None:
        self.public, self.upstream = public, upstream
        self.policy: AccessPolicy | None = None
        self.refused = 0
        self._server: asyncio.AbstractServer | None = None
        self._inode = 0

    async def start(self) -> None:
        claim_path(self.public)
        self._server = await asyncio.start_unix_server(self._handle, path=str(self.public))
        os.chmod(self.public, SOCKET_MODE)
        self._inode = self.public.stat().st_ino
        self.policy = AccessPolicy.for_socket(self.public)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
        with contextlib.suppress(OSError):  # only our own socket, not a successor's
            if self.public.stat().st_ino == self._inode:
                self.public.unlink()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.policy is not None
        try:
            allowed, cred = self.policy.check(writer.get_extra_info("socket"))
        except OSError as e:
            log.warning("admin socket: cannot read peer credentials (%s); refused", e)
            writer.close()
            return
        if not allowed:
            self.refused += 1
            log.warning(
                "admin socket: refused pid %d uid %d gid %d (not the daemon's user, root, or "
                "in the socket's group %d)",
                cred.pid, cred.uid, cred.gid, self.policy.gid,
            )  # fmt: skip
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(str(self.upstream))
        except OSError as e:
            log.warning("admin socket: gRPC server unreachable (%s)", e)
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
