"""The disk read-rate probe (formats/disk_rate.py) that ``ftctl bench bw`` and ``ftctl plan``
use: what it reads, its errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from freetokend.formats.direct_read import open_direct
from freetokend.formats.disk_rate import measure_disk_rate


def _file(path: Path, nbytes: int) -> Path:
    path.write_bytes(bytes(range(256)) * (nbytes // 256))
    return path


def test_reads_the_asked_bytes_in_pieces(tmp_path: Path) -> None:
    f = _file(tmp_path / "w.bin", 4 << 20)
    r = measure_disk_rate(f, nbytes=3 << 20, piece=1 << 20, depth=2)
    assert r.nbytes == 3 << 20
    assert r.bytes_per_s > 0
    fd = open_direct(f)
    assert r.direct == (fd is not None)
    if fd is not None:
        os.close(fd)


def test_a_file_smaller_than_the_sample_is_read_at_most_once_over(tmp_path: Path) -> None:
    f = _file(tmp_path / "small.bin", 64 << 10)
    r = measure_disk_rate(f, nbytes=1 << 30, piece=1 << 20)
    assert r.nbytes == 64 << 10  # one piece of the whole file


def test_bad_input(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        measure_disk_rate(empty)
    with pytest.raises(ValueError, match="positive"):
        measure_disk_rate(_file(tmp_path / "x.bin", 4096), piece=0)
    with pytest.raises(FileNotFoundError):
        measure_disk_rate(tmp_path / "missing.bin")
