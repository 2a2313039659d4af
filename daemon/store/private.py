"""Private modes for the daemon's state, whatever the process umask.

The state folder holds the SQLite store (model paths, request log) and spilled session
snapshots (the KV of users' prompts: their code and conversations). Outside systemd the daemon
runs with the login umask (often 022), so files created the default way are world-readable.
Folders we create are 0700 and files 0600; an existing file or folder of ours with group or
other bits keeps only the owner's bits, except a folder someone chose to share with a group
(systemd's StateDirectoryMode=0750 for group freetokend): its group may keep reading it, but
never writing.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """Creates ``path`` (and missing parents, those with the umask's mode) as a 0700 folder;
    an existing folder of ours loses write for group and others and every bit for others."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.geteuid() and st.st_mode & (stat.S_IRWXO | stat.S_IWGRP):
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_IRWXO | stat.S_IWGRP))
    return path


def private_file(path: Path) -> Path:
    """Creates ``path`` empty with mode 0600 unless it exists; an existing file of ours is
    made 0600 (a symlink is not followed)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE))
        os.chmod(path, FILE_MODE)  # O_CREAT's mode went through the umask
    except FileExistsError:
        restrict(path)
    return path


def restrict(path: Path) -> None:
    """An existing file of ours gets mode 0600 (a missing one is fine: nothing to protect)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.chmod(path, FILE_MODE)
