"""The disk read-rate probe (formats/disk_rate.py) that ``ftctl bench bw`` and ``ftctl plan``
use: what it reads, its errors; which file of a model ``ftctl bench bw`` reads for B_D
(manager/bench.py), what it says where it measured nothing, and the table's B_D row."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from freetokend.checkpoint.ftw_write import EXPERTS_FILE
from freetokend.formats.direct_read import open_direct
from freetokend.formats.disk_rate import measure_disk_rate
from freetokend.manager.bench import disk_fields, experts_file
from ftctl.bench_bw import _disk_file, _disk_rate


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


# --- ftctl bench bw's B_D: which file of a model it reads, what it says -------------------------


def _gguf(path: Path, nbytes: int) -> Path:
    path.write_bytes(b"GGUF" + bytes(nbytes - 4))  # the magic is all model_kind reads
    return path


def test_bench_reads_the_file_the_experts_live_in(tmp_path: Path) -> None:
    one = _gguf(tmp_path / "m-Q4_K_M.gguf", 1 << 20)
    assert experts_file(one) == (one, "the GGUF file")
    parts = [_gguf(tmp_path / f"s-0000{i}-of-00002.gguf", n) for i, n in ((1, 8192), (2, 65536))]
    assert experts_file(parts[0]) == (parts[1], "the largest of 2 GGUF parts")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    _file(hf / "model-00001-of-00002.safetensors", 4096)
    big = _file(hf / "model-00002-of-00002.safetensors", 8192)
    assert experts_file(hf) == (big, "the largest of the folder's 2 safetensors files")
    ftw = tmp_path / "ftw"
    ftw.mkdir()
    (ftw / "ftw.json").write_text("{}")
    _file(ftw / "dense.bin", 65536)
    experts = _file(ftw / EXPERTS_FILE, 8192)
    assert experts_file(ftw) == (experts, "the FTW folder's experts file")

    got = disk_fields(one)
    assert got["b_d"] > 0 and got["disk_path"] == str(one) and got["disk_note"] == "the GGUF file"
    fd = open_direct(one)
    assert got["disk_direct"] == (fd is not None)
    if fd is not None:
        os.close(fd)


def test_bench_says_why_it_measured_no_disk_rate(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert disk_fields(hf) == {
        "b_d": 0.0,
        "disk_note": "not measured: no safetensors file in the folder",
    }
    empty = tmp_path / "e.gguf"
    empty.write_bytes(b"")
    got = disk_fields(empty)  # not even the magic: not a GGUF file
    assert (
        got["b_d"] == 0.0
        and got["disk_note"].startswith("not measured: ")
        and "GGUF" in got["disk_note"]
    )
    gone = disk_fields(tmp_path / "moved-away.gguf")
    assert gone["b_d"] == 0.0 and "no such file" in gone["disk_note"]


def test_ftctl_bench_bw_disk_row() -> None:
    direct = {"b_d": 2.5e9, "disk_direct": True, "disk_note": "the GGUF file"}
    assert _disk_rate(direct) == "2.50 GB/s"
    assert _disk_rate({**direct, "disk_direct": False}) == "2.50 GB/s (page cache, not O_DIRECT)"
    none = {"b_d": 0.0, "disk_direct": False, "disk_note": "not measured: no safetensors file"}
    assert _disk_rate(none) == "not measured: no safetensors file"
    assert _disk_file({"disk_path": "/m/q/x-Q4_K_M.gguf", "disk_note": "the GGUF file"}) == (
        "x-Q4_K_M.gguf (the GGUF file)"
    )
    assert _disk_file({"disk_path": "", **none}) == "-"
