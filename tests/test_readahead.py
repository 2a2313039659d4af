"""runtime/readahead.py: the model file read into the page cache from the daemon's first moment
(issue 44 item 4, a cold start's disk reads overlapped with its imports)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from freetokend import cli
from freetokend.formats.gguf_file import set_name, split_files
from freetokend.runtime import readahead


def _file(path: Path, size: int = 3 << 20) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def test_model_files_are_a_gguf_file_or_its_split_set(tmp_path):
    one = _file(tmp_path / "m.gguf")
    assert readahead.model_files(str(one)) == [one]
    parts = [_file(tmp_path / f"big-{i:05d}-of-00003.gguf", 4096) for i in (1, 2, 3)]
    assert readahead.model_files(str(parts[1])) == parts == split_files(parts[1])
    assert set_name(parts[2]) == "big"
    assert readahead.model_files(str(tmp_path)) == []  # a folder (HF, FTW): not read ahead
    assert readahead.model_files("builtin") == []
    assert readahead.model_files(str(tmp_path / "missing.gguf")) == []
    _file(tmp_path / "x.safetensors", 16)
    assert readahead.model_files(str(tmp_path / "x.safetensors")) == []


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")
def test_a_file_is_read_ahead_on_a_thread(tmp_path, monkeypatch):
    """In pieces the kernel reads whole (one advice reads at most the device's window)."""
    monkeypatch.setattr(readahead, "piece_bytes", lambda st_dev: 1 << 20)
    path = _file(tmp_path / "m.gguf", (5 << 20) // 2)  # three pieces, the last one short
    advised = []
    fadvise = os.posix_fadvise

    def spy(fd, at, n, how):
        advised.append((at, n, how))
        fadvise(fd, at, n, how)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    t = readahead.start(str(path))
    assert t is not None and t.daemon
    t.join(30)
    assert not t.is_alive()
    will = os.POSIX_FADV_WILLNEED
    assert advised == [(0, 1 << 20, will), (1 << 20, 1 << 20, will), (2 << 20, 1 << 19, will)]
    advised.clear()  # ranges first (the loader's tensors where an early fill reads the experts)
    t = readahead.start(str(path), first=[(3 << 19, 1 << 21), (5 << 20, 4096)])
    assert t is not None
    t.join(30)
    assert advised[:1] == [(3 << 19, 1 << 20, will)]  # cut at the file's end; past it: nothing
    assert advised[1:] == [(0, 1 << 20, will), (1 << 20, 1 << 20, will), (2 << 20, 1 << 19, will)]


def test_a_piece_is_the_devices_read_ahead_window_or_largest_request(tmp_path):
    """The kernel cuts one WILLNEED advice to max(read_ahead_kb, max_sectors_kb) of the file's
    block device (a partition: its disk's queue); 128 KiB where sysfs does not say."""
    disk = tmp_path / "devices/vda"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue/read_ahead_kb").write_text("8192\n")
    (disk / "queue/max_sectors_kb").write_text("4096\n")
    (disk / "vda1").mkdir()
    (tmp_path / "dev/block").mkdir(parents=True)
    (tmp_path / "dev/block/254:0").symlink_to(disk)
    (tmp_path / "dev/block/254:1").symlink_to(disk / "vda1")
    assert readahead.piece_bytes(os.makedev(254, 0), tmp_path) == 8 << 20
    assert readahead.piece_bytes(os.makedev(254, 1), tmp_path) == 8 << 20  # the partition's disk
    (disk / "queue/read_ahead_kb").write_text("128\n")
    assert readahead.piece_bytes(os.makedev(254, 0), tmp_path) == 4 << 20
    (disk / "queue/max_sectors_kb").write_text("4\n")  # never under the kernel's default window
    (disk / "queue/read_ahead_kb").write_text("0\n")
    assert readahead.piece_bytes(os.makedev(254, 0), tmp_path) == readahead.MIN_PIECE
    assert readahead.piece_bytes(os.makedev(0, 42), tmp_path) == readahead.MIN_PIECE  # tmpfs


def test_a_file_over_half_the_available_memory_is_not_read_ahead(tmp_path, monkeypatch):
    path = _file(tmp_path / "m.gguf", 1 << 20)
    monkeypatch.setattr(readahead, "available_bytes", lambda: 2 * (1 << 20) - 2)
    assert readahead.start(str(path)) is None
    monkeypatch.setattr(readahead, "available_bytes", lambda: None)
    assert readahead.start(str(path)) is None


def test_a_file_over_half_the_cgroup_limit_is_not_read_ahead(tmp_path, monkeypatch):
    """The memory cgroup counts the page cache: a file over half its limit stays on disk."""
    path = _file(tmp_path / "m.gguf", 1 << 20)
    monkeypatch.setattr(readahead, "available_bytes", lambda: 1 << 40)
    monkeypatch.setattr(readahead, "cgroup_memory_limit", lambda: 2 * (1 << 20) - 2)
    assert readahead.start(str(path)) is None
    monkeypatch.setattr(readahead, "cgroup_memory_limit", lambda: 4 << 20)
    t = readahead.start(str(path))
    assert t is not None
    t.join()


def test_the_daemon_reads_ahead_unless_the_disk_tier_is_on(tmp_path, monkeypatch):
    """cli.main starts the read-ahead before its heavy imports, except where the experts stay
    in the file (disk_tier on)."""
    started = []
    monkeypatch.setattr(readahead, "start", lambda model, first=None: started.append(model))
    import freetokend.server.logs as logs
    import freetokend.server.run as run

    monkeypatch.setattr(run, "serve", lambda cfg: 0)
    monkeypatch.setattr(logs, "configure_logging", lambda: None)  # no process-wide setup
    monkeypatch.setattr(cli, "_stack_dumps_on_sigusr1", lambda: None)
    path = str(_file(tmp_path / "m.gguf", 16))
    assert cli.main(["--model", path, "--state-dir", str(tmp_path / "s")]) == 0
    assert started == [path]
    assert cli.main(["--model", path, "--disk-tier", "on", "--state-dir", str(tmp_path / "s")]) == 0
    assert started == [path]


def test_the_daemon_imports_with_the_collector_off_then_frozen(tmp_path, monkeypatch):
    """cli.main runs its heavy imports with the cyclic collector off, then freezes what they
    made and turns the collector back on before it serves (a collector left off would never
    free a cycle again)."""
    import gc

    import freetokend.server.logs as logs
    import freetokend.server.run as run

    seen = []
    monkeypatch.setattr(readahead, "start", lambda model: None)
    monkeypatch.setattr(run, "serve", lambda cfg: seen.append(gc.isenabled()) or 0)
    monkeypatch.setattr(logs, "configure_logging", lambda: None)
    monkeypatch.setattr(cli, "_stack_dumps_on_sigusr1", lambda: None)
    freeze = []
    monkeypatch.setattr(gc, "freeze", lambda: freeze.append(gc.isenabled()))
    assert gc.isenabled()
    assert cli.main(["--state-dir", str(tmp_path / "s")]) == 0
    assert freeze == [False]  # frozen once, right after the imports ran with it off
    assert seen == [True] and gc.isenabled()
