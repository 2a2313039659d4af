"""The model file read into the page cache while the daemon starts.

A cold start reads the weights from disk, and before the loader reads its first byte the daemon
spends seconds importing its libraries. ``start`` asks the kernel to read the file ahead
(``posix_fadvise(WILLNEED)``, in file order, a piece at a time on a thread of its own) from the
first moment, so the disk works while the interpreter imports; the loader then finds the pages
cached, or in flight. One advice reads at most the device's read-ahead window or its largest
request, whichever is larger (the kernel cuts a longer one short: 32 MiB pieces read 8 MiB of each
on a virtio disk with an 8 MiB window, a quarter of the file), so the pieces are that size, read
from sysfs for the file's device (128 KiB, the kernel's default window, where it is not found).
On a file already cached it costs a walk over the cached pages (tens of
ms a GB, on a thread beside the imports).

Only a file that fits in half of the available memory (within the process's memory cgroup, whose
limit counts the page cache) is read ahead: a larger one is what the disk tier leaves in the
file, and reading it all would evict what the page cache holds for others. Where the call does
not exist (not Linux) nothing is done.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from .memlimit import cgroup_memory_limit

MIN_PIECE = 128 << 10  # the kernel's default read-ahead window: what one advice reads at least
# a GGUF split set's file names (formats/gguf_file.py reads the set by them)
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def split_set(path: Path) -> list[Path]:
    """The names of every file of the split set ``name-0000i-of-0000N.gguf`` that ``path`` is
    one of, in order (whether they exist or not); ``path`` alone when it is no split file."""
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    n = int(m.group("n"))
    return [path.with_name(f"{m.group('stem')}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def model_files(model: str) -> list[Path]:
    """The files of a GGUF model given by path (a split set's every file), [] for anything else
    (a folder, the built-in model, a registered name)."""
    path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return []
    return [p for p in split_set(path) if p.is_file()]


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def free_bytes() -> int | None:
    """The memory available to this process: MemAvailable, within the memory cgroup's limit
    (which counts the page cache); None where it is not known."""
    free = available_bytes()
    limit = cgroup_memory_limit()
    if free is not None and limit is not None:
        free = min(free, limit)
    return free


def start(model: str, first: list[tuple[int, int]] | None = None) -> threading.Thread | None:
    """Starts reading ``model``'s files ahead (see the module doc); the thread, or None when
    nothing is read ahead. ``first``: byte ranges (offset, length) of the first file read ahead
    before the whole (the loader's own tensors where the experts are read by an early fill:
    formats/gguf_early.py, so a cold start's load finds them first)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    files = model_files(model)
    try:
        total = sum(p.stat().st_size for p in files)
    except OSError:
        return None
    free = free_bytes()
    if not files or free is None or total > free // 2:
        return None
    t = threading.Thread(
        target=_advise, args=(files, first or []), name="ft-readahead", daemon=True
    )
    t.start()
    return t


def piece_bytes(st_dev: int, sys_root: str | Path = "/sys") -> int:
    """The most bytes one WILLNEED advice reads on the block device ``st_dev``: the kernel caps
    it at the larger of the device's read-ahead window and its largest request
    (``queue/read_ahead_kb``, ``queue/max_sectors_kb``; a partition's are its disk's).
    ``MIN_PIECE`` where sysfs does not say (no such device: tmpfs, network and some layered
    file systems)."""
    dev = Path(sys_root) / "dev/block" / f"{os.major(st_dev)}:{os.minor(st_dev)}"
    for queue in (dev / "queue", dev / ".." / "queue"):
        kib = []
        for name in ("read_ahead_kb", "max_sectors_kb"):
            try:
                kib.append(int((queue / name).read_text()))
            except (OSError, ValueError):
                pass
        if kib:
            return max(MIN_PIECE, max(kib) << 10)
    return MIN_PIECE


def _advise(files: list[Path], first: list[tuple[int, int]]) -> None:
    for i, path in enumerate(files):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            size, piece = st.st_size, piece_bytes(st.st_dev)
            # (a range read ahead twice: the second advice walks pages already cached)
            for start, length in [*(first if i == 0 else []), (0, size)]:
                end = min(size, start + length)
                for at in range(start, end, piece):
                    os.posix_fadvise(fd, at, min(piece, end - at), os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # a hint: the loader reads the file anyway and reports what fails
        finally:
            os.close(fd)
