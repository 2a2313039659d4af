"""Where the admin socket lives, for the daemon and for ftctl.

Daemon (unless configured): ``$RUNTIME_DIRECTORY/admin.sock`` under systemd
(RuntimeDirectory=freetokend gives /run/freetokend), else ``$XDG_RUNTIME_DIR/freetoken/admin.sock``,
else ``/tmp/freetoken-UID/admin.sock`` (a private 0700 folder owned by the user).

ftctl: ``--socket``, else ``$FREETOKEN_ADMIN_SOCKET``, else the per-user path when a daemon of
this user listens there, else the system daemon's /run/freetokend/admin.sock. Before it
connects, ftctl checks that no other user could have placed the socket there
(``check_trusted``): a socket planted in /tmp by another local user would otherwise receive
ftctl's commands and answer with that user's URL, which ``ftctl launch`` writes into the coding
agent's configuration.
"""

from __future__ import annotations

import os
import pwd
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


class UntrustedSocket(PermissionError):
    """The admin socket, or its folder, could have been placed by another user."""


def _owner(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _folder_problem(folder: Path, st: os.stat_result, trusted: set[int]) -> str | None:
    """Why ``folder`` may hold a socket another user put there; None when it cannot.

    Trusted: a folder of the caller or root that nobody else can write to (the per-user
    folders), or one that others cannot write to inside a parent only root writes to (what
    systemd's RuntimeDirectory= makes: /run/freetokend, owned by the service user)."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if st.st_uid in trusted and not writable_by_others:
        return None
    if not st.st_mode & stat.S_IWOTH:
        parent = folder.parent.stat()
        if parent.st_uid == 0 and not parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
    if st.st_uid not in trusted:
        return f"its folder {folder} belongs to {_owner(st.st_uid)}, not to you or root"
    return f"its folder {folder} can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"


def check_trusted(path: Path, uid: int | None = None) -> None:
    """Raises UntrustedSocket unless the socket at ``path`` (which exists) can only have been
    put there by the caller (``uid``, default: this process's), root, or a service whose
    folder root made. Everything a client does with an admin socket (model names, the API
    URL and key it hands to agents) trusts the process behind it."""
    uid = os.getuid() if uid is None else uid
    trusted = {uid, 0}
    folder = path.parent
    folder_st = folder.stat()
    problem = _folder_problem(folder, folder_st, trusted)
    st = path.lstat()
    if problem is None and not stat.S_ISSOCK(st.st_mode):
        problem = "it is not a socket"
    if problem is None and st.st_uid not in trusted | {folder_st.st_uid}:
        problem = f"it belongs to {_owner(st.st_uid)}"
    if problem is not None:
        raise UntrustedSocket(
            f"refusing the admin socket {path}: {problem}; another user may have planted it "
            "(remove it, or pass --socket PATH)"
        )
