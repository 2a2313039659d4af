"""The default host-pool budget honours the process's memory cgroup (runtime/memlimit.py), read
from fake /proc and /sys trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from freetokend.runtime.memlimit import (
    RUNTIME_RESERVE_BYTES,
    cgroup_memory_limit,
    host_pool_budget,
    memory_left,
    physical_ram,
    process_resident_bytes,
    release_free_heap,
)

GIB = 1 << 30


def _tree(root: Path, cgroup: str, files: dict[str, str], ram_gib: int = 64) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/meminfo").write_text(f"MemTotal:       {ram_gib * 1024 * 1024} kB\n")
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_no_cgroup_limit_is_three_quarters_of_ram(tmp_path: Path) -> None:
    root = _tree(tmp_path, "0::/user.slice/x.scope\n", {
        "sys/fs/cgroup/user.slice/x.scope/memory.max": "max\n",
        "sys/fs/cgroup/user.slice/memory.max": "max\n",
    })  # fmt: skip
    assert physical_ram(root) == 64 * GIB
    assert cgroup_memory_limit(root) is None
    assert host_pool_budget(root) == 48 * GIB


def test_v2_limit_of_the_cgroup_or_an_ancestor(tmp_path: Path) -> None:
    root = _tree(tmp_path / "a", "0::/system.slice/freetokend.service\n", {
        "sys/fs/cgroup/system.slice/freetokend.service/memory.max": str(20 * GIB),
        "sys/fs/cgroup/system.slice/memory.max": "max",
    })  # fmt: skip
    assert cgroup_memory_limit(root) == 20 * GIB
    assert host_pool_budget(root) == 20 * GIB - RUNTIME_RESERVE_BYTES
    assert host_pool_budget(root, other_bytes=GIB) == 19 * GIB - RUNTIME_RESERVE_BYTES
    # a parent's smaller limit binds the child
    root = _tree(tmp_path / "b", "0::/system.slice/freetokend.service\n", {
        "sys/fs/cgroup/system.slice/freetokend.service/memory.max": "max",
        "sys/fs/cgroup/system.slice/memory.max": str(8 * GIB),
    })  # fmt: skip
    assert cgroup_memory_limit(root) == 8 * GIB
    # RAM smaller than the limit: 3/4 of RAM still bounds it
    root = _tree(tmp_path / "c", "0::/s\n", {"sys/fs/cgroup/s/memory.max": str(60 * GIB)}, 16)
    assert host_pool_budget(root) == 12 * GIB


def test_v1_memory_controller(tmp_path: Path) -> None:
    cg = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    root = _tree(tmp_path / "a", cg, {
        "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": str(6 * GIB),
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",  # unlimited
    })  # fmt: skip
    assert cgroup_memory_limit(root) == 6 * GIB
    # a namespaced path that does not exist under the mount: the mount is the container's own
    root = _tree(tmp_path / "b", cg, {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": str(3 * GIB),
    })  # fmt: skip
    assert cgroup_memory_limit(root) == 3 * GIB
    assert host_pool_budget(root) == 1 * GIB
    # a limit smaller than the reserve: no room, never negative
    root = _tree(tmp_path / "c", cg, {"sys/fs/cgroup/memory/memory.limit_in_bytes": str(GIB)})
    assert host_pool_budget(root) == 0


def test_unreadable_cgroup_files_mean_no_limit(tmp_path: Path) -> None:
    root = _tree(tmp_path, "garbage\n0::/gone\n", {"sys/fs/cgroup/memory.max": "not a number"})
    assert cgroup_memory_limit(root) is None
    assert cgroup_memory_limit(tmp_path / "nowhere") is None
    assert host_pool_budget() > 0  # this machine, whatever its cgroup


def test_memory_left_is_the_limit_less_what_the_process_holds(tmp_path: Path) -> None:
    status = "Name:\tpython\nVmRSS:\t 3000 kB\nRssAnon:\t 2048 kB\nRssFile:\t 900 kB\nRssShmem:\t 1024 kB\n"
    root = _tree(tmp_path / "a", "0::/s\n", {
        "sys/fs/cgroup/s/memory.max": str(GIB),
        "proc/self/status": status,
    })  # fmt: skip
    held = process_resident_bytes(root)
    assert held == 3 << 20  # anonymous and shared pages; file pages can be reclaimed
    assert memory_left(root) == GIB - held
    assert memory_left(root, reserve_bytes=100 << 20) == GIB - held - (100 << 20)
    assert memory_left(root, reserve_bytes=2 * GIB) == 0
    # no cgroup limit: 3/4 of RAM bounds it
    root = _tree(tmp_path / "b", "0::/s\n", {"proc/self/status": status}, ram_gib=4)
    assert memory_left(root) == 3 * GIB - held
    assert 0 < process_resident_bytes() < 64 * GIB  # this process's own


def test_release_free_heap_returns_what_was_freed() -> None:
    """The heap's freed pages leave RssAnon (a load's transient buffers are not held when the
    disk tier's cache is sized): 32 MiB of 1 KiB blocks (the C heap, not their own maps) freed
    below one kept block (so the heap's top is not trimmed on the way) stay held until then."""
    blocks = [bytearray(1024) for _ in range(32 * 1024)]
    keep = bytearray(1024)  # above them on the heap
    before = process_resident_bytes()
    del blocks
    if not release_free_heap():
        pytest.skip("no malloc_trim here (not glibc)")
    assert process_resident_bytes() < before - (16 << 20)
    assert len(keep) == 1024
