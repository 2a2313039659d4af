"""systemd readiness notification (sd_notify) over a plain datagram socket, no dependency.

``Type=notify`` units start ``freetokend`` with ``$NOTIFY_SOCKET``; the daemon sends READY=1
once the HTTP API listens (the model is loaded), STOPPING=1 when it starts draining, and STATUS=
lines for ``systemctl status``. Outside systemd (no NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import os
import socket


def notify(*assignments: str, env: dict[str, str] | None = None) -> bool:
    """Send ``KEY=VALUE`` lines; True when a notification socket was there to send to."""
    addr = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in ("/", "@"):
        return False
    target = "\0" + addr[1:] if addr[0] == "@" else addr  # "@": the abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        # never blocks the caller (the event loop sends the watchdog pings): a full queue
        # raises BlockingIOError instead
        s.setblocking(False)
        s.connect(target)
        s.sendall("\n".join(assignments).encode())
    return True
