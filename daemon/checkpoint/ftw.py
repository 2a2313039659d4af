"""FTW, the fast weight format (ARCHITECTURE §7): the checkpoint pre-laid-out in runtime layout.

Not a quantisation: every dense parameter and every flat_id-major expert bank is one raw,
4 KiB-aligned extent (``dense.bin``, ``experts.bin``), indexed by ``ftw.json`` (see
``ftw_index``). This module is the reader, and knows no model: ``read_tensors`` checks the index
against the tensors a caller expects (name -> shape, dtype), allocates exact-size tensors and
fills them with parallel direct reads. ``models.ftw_loader`` composes them into a model and
``models.ftw_convert`` writes an FTW folder from any checkpoint the loader reads.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .ftw_index import INDEX_NAME, Entry, FtwError, FtwIndex, read_index
from .ftw_io import ReadJob, aligned_empty, default_threads, read_all, sha256_tensor

__all__ = ["FtwError", "FtwIndex", "INDEX_NAME", "Spec", "read_index", "read_tensors"]

Spec = tuple[tuple[int, ...], torch.dtype]


def _match(idx: FtwIndex, want: dict[str, Spec], folder: Path) -> list[Entry]:
    have = {e.name: e for e in idx.tensors}
    for name in want:
        if name not in have:
            raise FtwError(f"{folder}: tensor '{name}' is missing from {INDEX_NAME}")
    for name, e in have.items():
        if name not in want:
            raise FtwError(f"{folder}: unexpected tensor '{name}' (the model has no such weight)")
        shape, dt = want[name]
        if e.shape != shape or e.torch_dtype != dt:
            raise FtwError(
                f"{folder}: tensor '{name}' is {e.shape} {e.dtype}; the model needs {shape} {dt}"
            )
    return list(idx.tensors)


def _verify(entries: list[Entry], tensors: dict[str, torch.Tensor], threads: int | None) -> None:
    with ThreadPoolExecutor(threads or default_threads()) as pool:
        digests = pool.map(lambda e: sha256_tensor(tensors[e.name]), entries)
        for e, d in zip(entries, digests, strict=True):
            if d != e.sha256:
                raise FtwError(
                    f"{e.file}: tensor '{e.name}' content hash mismatch (data file corrupted)"
                )


def read_tensors(
    folder: str | Path,
    idx: FtwIndex,
    want: dict[str, Spec],
    *,
    threads: int | None = None,
    direct: bool = True,
    verify: bool = False,
) -> dict[str, torch.Tensor]:
    """Every tensor of the index, checked against ``want`` (name -> shape, dtype: none missing,
    none unexpected), read into exact-size, 4 KiB-aligned tensors.

    threads  parallel read requests (default: 2 per core, 4..16)
    direct   use O_DIRECT where the filesystem allows it (buffered reads otherwise)
    verify   re-hash every tensor after reading (slow; the index and sizes are always checked)
    """
    folder = Path(folder)
    entries = _match(idx, want, folder)
    tensors: dict[str, torch.Tensor] = {}
    jobs = []
    for e in entries:
        t, region = aligned_empty(e.shape, e.torch_dtype)
        tensors[e.name] = t
        jobs.append(ReadJob(folder / e.file, e.offset, region, e.nbytes))
    read_all(jobs, threads, direct)
    if verify:
        _verify(entries, tensors, threads)
    return tensors
