"""The disk's read rate as the disk tier sees it (``ftctl bench bw``, ``ftctl plan``): reads of
one expert projection's size (1 MiB) at random aligned offsets of a weights file, several in
flight, through ``O_DIRECT`` where the file system takes it (the tier's own reads,
formats/direct_read.py), so the page cache neither serves nor keeps them.

Where ``O_DIRECT`` is refused (tmpfs) the reads go through the page cache and the figure is the
cache's, which the result says (``direct`` False). The offsets are a fixed pseudo-random draw
(seeded), spread over the whole file, so a repeat reads the same places.
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .direct_read import ALIGN, open_direct, read_staged

PIECE = 1 << 20  # one expert projection of Qwen3-30B-A3B's geometry in Q4_K is about 1 MB
DEPTH = 8  # reads in flight: the disk tier's
SAMPLE = 256 << 20  # bytes read at most


@dataclass(frozen=True)
class DiskRate:
    path: str
    bytes_per_s: float
    nbytes: int  # bytes read
    direct: bool  # O_DIRECT reads (False: through the page cache, which may have served them)


def measure_disk_rate(
    path: str | os.PathLike[str],
    nbytes: int = SAMPLE,
    piece: int = PIECE,
    depth: int = DEPTH,
    seed: int = 0,
) -> DiskRate:
    """Reads ``nbytes`` (at most the file's size) of ``path`` in ``piece``-byte reads at random
    ``ALIGN``-aligned offsets, ``depth`` at a time, and returns the rate. Raises OSError for a
    file that cannot be read, ValueError for an empty one or bad sizes."""
    if piece < 1 or depth < 1 or nbytes < 1:
        raise ValueError("piece, depth and nbytes must be positive")
    size = Path(path).stat().st_size
    if size == 0:
        raise ValueError(f"{path}: the file is empty")
    piece = min(piece, size)
    slots = max(1, (size - piece) // ALIGN + 1)
    rng = random.Random(seed)
    count = max(1, min(nbytes, size) // piece)
    offsets = [rng.randrange(slots) * ALIGN for _ in range(count)]
    fd = open_direct(path)
    direct = fd is not None
    if fd is None:
        fd = os.open(path, os.O_RDONLY)

    def read(offset: int) -> int:
        return int(read_staged(fd, offset, piece, direct, str(path)).numel())

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(depth) as pool:
            got = sum(pool.map(read, offsets))
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
    return DiskRate(str(path), got / max(elapsed, 1e-9), got, direct)
