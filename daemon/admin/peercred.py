"""Who is on the other end of a unix socket (SO_PEERCRED), and whether the admin API lets them in.

The kernel records the credentials of the connecting process at connect() time; they cannot be
forged by the client. A caller is allowed when it runs as the daemon's own uid or as root, or
when the admin socket's group is its primary group or one of its supplementary groups (under
systemd the socket belongs to group ``freetokend``: adding a user to it grants ``ftctl``).
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
_MAX_GROUPS = 1024


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: Any) -> PeerCred:
    """The connecting process's pid, uid and gid (a socket or asyncio TransportSocket)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


def peer_groups(sock: Any, pid: int) -> frozenset[int]:
    """Supplementary groups of the peer: SO_PEERGROUPS, else /proc/PID/status, else none."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * _MAX_GROUPS)
        return frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:
        pass
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


@dataclass(frozen=True)
class AccessPolicy:
    uid: int  # the daemon's uid
    gid: int  # the admin socket's group

    @classmethod
    def for_socket(cls, path: str | Path) -> AccessPolicy:
        return cls(os.getuid(), os.stat(path).st_gid)

    def allows(self, cred: PeerCred, groups: frozenset[int] = frozenset()) -> bool:
        return cred.uid in (self.uid, 0) or cred.gid == self.gid or self.gid in groups

    def check(self, sock: Any) -> tuple[bool, PeerCred]:
        """Read the peer's credentials from a connected socket and decide."""
        cred = peer_credentials(sock)
        if self.allows(cred):
            return True, cred
        return self.allows(cred, peer_groups(sock, cred.pid)), cred
