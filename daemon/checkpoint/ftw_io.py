"""FTW I/O: page-aligned exact-size buffers, parallel (direct) reads, hashing, pinning.

Loading reads every extent straight into the tensor that keeps it (no staging copy): the buffer
starts on a 4 KiB boundary and owns the extent's padding, so O_DIRECT can read whole aligned
chunks into it. Where the filesystem refuses O_DIRECT (tmpfs, some network filesystems), the same
reads go through the page cache. Pinning (cudaHostRegister) happens after the fill, so the pages
are touched once by the reads rather than zeroed by the pinning first.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime import pinning
from .ftw_index import ALIGN, FtwError, align_up

log = logging.getLogger(__name__)

CHUNK = 16 << 20  # bytes per read request: large enough for the device, small enough to spread
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def default_threads() -> int:
    # I/O-bound: more requests in flight than cores keeps an NVMe queue busy.
    return max(4, min(16, 2 * (os.cpu_count() or 1)))


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An uninitialised tensor whose data starts on a 4 KiB boundary, and a uint8 view of its
    extent rounded up to 4 KiB (what a direct read fills). The storage is that rounded size plus
    one page of slack for the alignment; nothing is touched until it is read into."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    padded = align_up(nbytes)
    raw = torch.empty(padded + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    region = raw[skip : skip + padded]
    return region[:nbytes].view(dtype).view(shape), region


@dataclass(frozen=True)
class ReadJob:
    path: Path
    offset: int  # 4 KiB aligned
    region: torch.Tensor  # uint8, page-aligned, length a multiple of 4 KiB
    nbytes: int  # the bytes that matter; the rest of the region is padding


class _Files:
    """One buffered and (where allowed) one O_DIRECT descriptor per data file."""

    def __init__(self, paths: set[Path], direct: bool) -> None:
        self.buffered: dict[Path, int] = {}
        self.direct: dict[Path, int] = {}
        self.retired: list[int] = []
        self.lock = threading.Lock()
        for p in paths:
            try:
                self.buffered[p] = os.open(p, os.O_RDONLY)
            except OSError as e:
                self.close()
                raise FtwError(f"{p}: cannot open ({e.strerror})") from None
            if direct and _O_DIRECT:
                try:
                    self.direct[p] = os.open(p, os.O_RDONLY | _O_DIRECT)
                except OSError:
                    log.info("%s: O_DIRECT not supported here; buffered reads", p)

    def drop_direct(self, p: Path) -> None:
        # Not closed here: another thread may be reading through it, and a closed number could
        # be reused by an unrelated open before that read starts.
        with self.lock:
            fd = self.direct.pop(p, None)
            if fd is not None:
                self.retired.append(fd)

    def close(self) -> None:
        for fd in [*self.buffered.values(), *self.direct.values(), *self.retired]:
            os.close(fd)
        self.buffered.clear()
        self.direct.clear()
        self.retired.clear()


def _pread_full(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise FtwError(f"{path}: unexpected end of file at byte {offset + done} (truncated?)")
        done += n


def _read_chunk(files: _Files, path: Path, offset: int, chunk: torch.Tensor, want: int) -> None:
    """chunk: uint8 page-aligned view; want: how many of its bytes hold data (rest is padding)."""
    buf = chunk.numpy().data
    fd = files.direct.get(path)
    if fd is not None:
        try:
            _pread_full(fd, buf, offset, path)
            return
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise FtwError(f"{path}: read failed at byte {offset} ({e.strerror})") from None
            files.drop_direct(path)  # the filesystem accepted O_DIRECT at open but not for reads
    try:
        _pread_full(files.buffered[path], buf[:want], offset, path)
    except OSError as e:
        raise FtwError(f"{path}: read failed at byte {offset} ({e.strerror})") from None


def read_all(jobs: list[ReadJob], threads: int | None = None, direct: bool = True) -> int:
    """Fills every job's region from its file extent with a thread pool; returns bytes read."""
    files = _Files({j.path for j in jobs}, direct)
    tasks = []
    for j in jobs:
        for start in range(0, j.region.numel(), CHUNK):
            chunk = j.region[start : start + CHUNK]
            tasks.append(
                (j.path, j.offset + start, chunk, max(0, min(chunk.numel(), j.nbytes - start)))
            )
    # big chunks first so one straggler does not end the load alone
    tasks.sort(key=lambda t: -t[2].numel())
    try:
        with ThreadPoolExecutor(
            threads or default_threads(), thread_name_prefix="ftw-read"
        ) as pool:
            for fut in [pool.submit(_read_chunk, files, *t) for t in tasks]:
                fut.result()
    finally:
        files.close()
    return sum(j.nbytes for j in jobs)


def sha256_tensor(t: torch.Tensor) -> str:
    """Content hash of a contiguous CPU tensor's bytes (hashlib drops the GIL on big buffers)."""
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    h = hashlib.sha256()
    for start in range(0, flat.numel(), CHUNK):
        h.update(flat[start : start + CHUNK].numpy().data)
    return h.hexdigest()


def sha256_extent(path: Path, offset: int, nbytes: int) -> str:
    """Content hash of a file extent, read in chunks (used to verify a written file)."""
    h = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        buf = bytearray(min(CHUNK, max(nbytes, 1)))
        view = memoryview(buf)
        done = 0
        while done < nbytes:
            n = os.preadv(f.fileno(), [view[: min(len(buf), nbytes - done)]], offset + done)
            if n == 0:
                raise FtwError(f"{path}: unexpected end of file at byte {offset + done}")
            h.update(view[:n])
            done += n
    return h.hexdigest()


def evict(path: Path) -> None:
    """Drops the file's clean pages from the page cache, so the next read comes from the disk."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory so a rename inside it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pin(tensors: list[torch.Tensor]) -> int:
    """Page-locks filled host tensors for DMA and zero-copy reads (cudaHostRegister, portable |
    mapped, through the process-wide registry in runtime.pinning) when CUDA is available;
    returns how many are pinned. Each registration is undone on unload or when its tensor is
    collected."""
    if not torch.cuda.is_available():
        return 0
    pinned = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if size == 0:
            continue
        rc = pinning.register(t)
        if rc != 0:
            log.warning(
                "cudaHostRegister of %d bytes failed (error %s); tensor stays pageable", size, rc
            )
            continue
        pinned += 1
    return pinned
