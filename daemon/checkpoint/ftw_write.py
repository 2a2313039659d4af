"""FTW writer: lays tensors out as 4 KiB-aligned raw extents, verifies, then renames into place.

Everything is written into ``<out>.tmp-<pid>`` beside the destination: data files (hashed while
written), config/tokenizer copies, then the data is fsynced, dropped from the page cache and
re-read from the disk to compare hashes, and only then ``ftw.json`` is written and the folder
renamed to ``<out>``. A conversion that fails or is interrupted removes its temporary folder; one
that is killed leaves a temporary folder without an index, which no reader accepts and the next
conversion to the same destination deletes. ``--force`` keeps the old folder until the new one
is complete.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import torch

from .ftw_index import (
    ALIGN,
    INDEX_NAME,
    VERSION,
    Entry,
    FtwError,
    FtwIndex,
    align_up,
    dtype_name,
    fingerprint,
)
from .ftw_io import CHUNK, default_threads, evict, fsync_path, sha256_extent

# (phase "write" | "verify", bytes done, bytes in all)
Progress = Callable[[str, int, int], None]

# Files copied beside the weights so an FTW folder serves on its own (config.json always).
AUX_PATTERNS = (
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template*",
    "*.jinja",
)
DENSE_FILE, EXPERTS_FILE = "dense.bin", "experts.bin"


def aux_files(model_dir: Path) -> list[Path]:
    """The config/tokenizer/template files of a model folder worth copying."""
    return sorted(
        p
        for p in model_dir.iterdir()
        if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in AUX_PATTERNS)
    )


def check_destination(out: Path, force: bool) -> None:
    """Fails early when ``out`` exists and may not be replaced."""
    if not out.exists():
        return
    if not force:
        raise FtwError(f"{out} already exists (pass --force to replace it)")
    if not out.is_dir() or not ((out / INDEX_NAME).exists() or not any(out.iterdir())):
        raise FtwError(f"refusing to replace {out}: it is not an FTW checkpoint folder")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(out: Path) -> None:
    """Deletes temporary folders of earlier conversions to ``out`` whose process is gone."""
    for p in out.parent.glob(f"{out.name}.tmp-*"):
        suffix = p.name.rsplit("-", 1)[-1]
        if suffix.isdigit() and int(suffix) != os.getpid() and not _pid_alive(int(suffix)):
            shutil.rmtree(p, ignore_errors=True)


def _write_tensor(f: BinaryIO, t: torch.Tensor, report: Callable[[int], None]) -> str:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.sha256()
    for start in range(0, flat.numel(), CHUNK):
        buf = flat[start : start + CHUNK].numpy().data
        f.write(buf)
        h.update(buf)
        report(len(buf))
    return h.hexdigest()


def _write_data(
    tmp: Path, tensors: list[tuple[str, torch.Tensor]], progress: Progress | None
) -> tuple[list[Entry], dict[str, int]]:
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    done = 0

    def report(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress("write", done, total)

    entries: list[Entry] = []
    sizes: dict[str, int] = {}
    for fname in (DENSE_FILE, EXPERTS_FILE):
        group = [(n, t) for n, t in tensors if (fname == EXPERTS_FILE) == n.startswith("experts.")]
        if not group:
            continue
        with (tmp / fname).open("wb") as f:
            for name, t in group:
                offset = f.tell()
                digest = _write_tensor(f, t, report)
                nbytes = t.numel() * t.element_size()
                f.write(b"\0" * (align_up(nbytes) - nbytes))
                entries.append(
                    Entry(name, tuple(t.shape), dtype_name(t.dtype), fname, offset, nbytes, digest)
                )
            f.flush()
            os.fsync(f.fileno())
            sizes[fname] = f.tell()
        assert sizes[fname] % ALIGN == 0
    return entries, sizes


def _verify(
    tmp: Path, entries: list[Entry], files: dict[str, int], progress: Progress | None
) -> None:
    """Re-reads every extent from the disk (page cache dropped first) and compares hashes."""
    for fname in files:
        evict(tmp / fname)
    total, done = sum(e.nbytes for e in entries), 0
    with ThreadPoolExecutor(default_threads(), thread_name_prefix="ftw-verify") as pool:
        futs = [(e, pool.submit(sha256_extent, tmp / e.file, e.offset, e.nbytes)) for e in entries]
        for e, fut in futs:
            if fut.result() != e.sha256:
                raise FtwError(
                    f"{tmp / e.file}: tensor '{e.name}' reads back different from what was written"
                )
            done += e.nbytes
            if progress:
                progress("verify", done, total)


def _swap_in(tmp: Path, out: Path) -> None:
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_path(out.parent)
    if old.exists():
        shutil.rmtree(old)


def write_ftw(
    out: str | Path,
    tensors: list[tuple[str, torch.Tensor]],
    config_bytes: bytes,
    aux: list[Path],
    expert_format: str,
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> FtwIndex:
    """Writes an FTW folder at ``out`` atomically.

    tensors  (name, CPU tensor) in file order; ``experts.*`` go to experts.bin, the rest to dense.bin
    config_bytes  config.json's exact bytes (part of the fingerprint)
    aux      files copied as they are (tokenizer, templates, generation config)
    """
    out = Path(out).absolute()
    check_destination(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        entries, files = _write_data(tmp, tensors, progress)
        (tmp / "config.json").write_bytes(config_bytes)
        for p in aux:
            shutil.copyfile(p, tmp / p.name)
        for p in tmp.iterdir():
            fsync_path(p)
        _verify(tmp, entries, files, progress)
        index = FtwIndex(
            version=VERSION,
            fingerprint=fingerprint(config_bytes, entries),
            expert_format=expert_format,
            files=files,
            tensors=tuple(entries),
            aux_files=tuple(p.name for p in aux),
        )
        part = tmp / f"{INDEX_NAME}.part"
        part.write_text(index.to_json())
        fsync_path(part)
        os.rename(part, tmp / INDEX_NAME)
        fsync_path(tmp)
        _swap_in(tmp, out)
        return index
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
