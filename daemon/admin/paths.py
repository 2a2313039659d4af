"""Where the admin socket lives, for the daemon and for ftctl.

Daemon (unless configured): ``$RUNTIME_DIRECTORY/admin.sock`` under systemd
(RuntimeDirectory=freetokend gives /run/freetokend), else ``$XDG_RUNTIME_DIR/freetoken/admin.sock``,
else ``/tmp/freetoken-UID/admin.sock`` (a private 0700 folder owned by the user).

ftctl: ``--socket``, else ``$FREETOKEN_ADMIN_SOCKET``, else the per-user path when a daemon of
this user listens there, else the system daemon's /run/freetokend/admin.sock.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

SYSTEM_SOCKET = Path("/run/freetokend/admin.sock")
ENV_SOCKET = "FREETOKEN_ADMIN_SOCKET"


def user_socket(env: Mapping[str, str]) -> Path:
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / "admin.sock"
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "freetoken" / "admin.sock"
    return Path(tempfile.gettempdir()) / f"freetoken-{os.getuid()}" / "admin.sock"


def daemon_socket(configured: str | None, env: Mapping[str, str] | None = None) -> Path | None:
    """The path the daemon listens on; None when configured "off"."""
    if configured is not None:
        return None if configured.strip().lower() == "off" else Path(configured).expanduser()
    return user_socket(os.environ if env is None else env)


def client_socket(explicit: str | None, env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit).expanduser()
    if env.get(ENV_SOCKET):
        return Path(env[ENV_SOCKET]).expanduser()
    mine = user_socket(env)
    return mine if mine.exists() or not SYSTEM_SOCKET.exists() else SYSTEM_SOCKET


def prepare_dir(path: Path) -> None:
    """Create the socket's folder; a folder we create is private (0700). Refuse a folder in a
    shared place (/tmp) that another user owns or others can write to."""
    folder = path.parent
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    shared = folder.parent == Path(tempfile.gettempdir())
    if shared and (st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise PermissionError(f"{folder} is not a private folder of this user")
