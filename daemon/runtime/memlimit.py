"""How much host RAM the resident models' weights may take (``host_pool_budget_gb`` = 0).

Three quarters of physical RAM, and never more than the process's memory cgroup allows less what
the rest of the process needs (``RUNTIME_RESERVE_BYTES`` plus whatever the caller adds: the
recurrent-state snapshots' budget). The cgroup is the process's own, named in /proc/self/cgroup:

- cgroup v2 (the ``0::/path`` line): ``memory.max`` of that cgroup and of every ancestor up to
  the mount (a parent's limit binds its children), "max" meaning none;
- cgroup v1 (the line whose controllers include ``memory``): ``memory.limit_in_bytes`` of that
  cgroup and its ancestors under the memory controller's mount; values near 2^63 mean none.

Inside a container the path in /proc/self/cgroup may not exist under the mount (the container
sees its own cgroup as the root): the walk then starts at the mount itself. ``root`` prefixes
every path read, so that tests hand in a fake /proc and /sys.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from pathlib import Path

RUNTIME_RESERVE_BYTES = 2 << 30  # Python, torch, tokenizers, work buffers, the KV pool's start
_V1_UNLIMITED = 1 << 62  # v1 writes PAGE_COUNTER_MAX * page size (~2^63) for "no limit"


def physical_ram(root: str | Path = "/") -> int:
    """Bytes of physical RAM (MemTotal of ``root``/proc/meminfo; sysconf for the real root)."""
    if str(root) == "/":
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for line in (Path(root) / "proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{root}/proc/meminfo has no MemTotal")


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _V1_UNLIMITED else value


def _walk(mount: Path, cgroup: str, name: str) -> int | None:
    """The smallest ``name`` limit of ``cgroup`` (a path under ``mount``) and its ancestors."""
    rel = Path(cgroup.lstrip("/"))
    start = mount / rel
    if not start.is_dir():  # a namespaced path: the container's own cgroup is the mount
        start = mount
    limits = []
    d = start
    while True:
        v = _read_limit(d / name)
        if v is not None:
            limits.append(v)
        if d == mount or mount not in d.parents:
            break
        d = d.parent
    return min(limits) if limits else None


def cgroup_memory_limit(root: str | Path = "/") -> int | None:
    """The memory limit (bytes) of this process's cgroup, v2 or v1; None when there is none."""
    base = Path(root)
    try:
        lines = (base / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2's unified hierarchy
            v = _walk(base / "sys/fs/cgroup", path, "memory.max")
        elif "memory" in controllers.split(","):
            v = _walk(base / "sys/fs/cgroup/memory", path, "memory.limit_in_bytes")
        else:
            continue
        if v is not None:
            found.append(v)
    return min(found) if found else None


def host_pool_budget(root: str | Path = "/", other_bytes: int = 0) -> int:
    """Bytes the resident models' weights may take by default: 3/4 of physical RAM, at most the
    cgroup's limit less ``RUNTIME_RESERVE_BYTES`` and ``other_bytes`` (snapshots, ...); never
    below zero."""
    budget = physical_ram(root) * 3 // 4
    limit = cgroup_memory_limit(root)
    if limit is not None:
        budget = min(budget, limit - RUNTIME_RESERVE_BYTES - other_bytes)
    return max(0, int(budget))


TIER_WORK_RESERVE_BYTES = 160 << 20  # step buffers, read bounce buffers, the code's file pages


def process_resident_bytes(root: str | Path = "/") -> int:
    """Bytes of this process's memory that no reclaim can take back without swap: anonymous and
    shared pages (RssAnon + RssShmem of ``root``/proc/self/status)."""
    total = 0
    for line in (Path(root) / "proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssShmem"):
            total += int(value.split()[0]) * 1024
    return total


def release_free_heap() -> bool:
    """Hands the memory the process has freed back to the system before it is measured: a
    garbage collection, then the C heap's free pages returned (glibc's ``malloc_trim``; a load
    frees ~80 MB of transient buffers that the heap otherwise keeps, counted in RssAnon as held:
    4.27 GB GGUF of bench_disk_tier at a 1018 MiB limit, 342 -> 426 MiB left for the disk
    tier's cache). False where the C library has no ``malloc_trim`` (not glibc): nothing
    returned beyond the collection."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def memory_left(root: str | Path = "/", reserve_bytes: int = 0) -> int:
    """Bytes this process may still take for itself: 3/4 of physical RAM, within its memory
    cgroup's limit, less what it holds now (``process_resident_bytes``) and ``reserve_bytes``
    (what it will need beside: the KV pool, ``TIER_WORK_RESERVE_BYTES``); never below zero.
    The disk tier's RAM cache takes it when none is set (engine/build.py): the cache is sized
    once the dense weights are loaded, from the memory they measurably left (after
    ``release_free_heap``: what the load freed is not held)."""
    cap = physical_ram(root) * 3 // 4
    limit = cgroup_memory_limit(root)
    if limit is not None:
        cap = min(cap, limit)
    return max(0, int(cap - process_resident_bytes(root) - reserve_bytes))
