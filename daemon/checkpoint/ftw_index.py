"""The FTW index (``ftw.json``): format version, fingerprint and the tensor table.

An FTW folder holds raw data files whose every tensor starts on a 4 KiB boundary, ``ftw.json``,
and copies of config.json, tokenizer and template files. ``ftw.json`` is written last, inside a
temporary folder that is renamed into place, so a folder with a valid index is a complete,
verified conversion. The fingerprint covers config.json's bytes and every tensor's name, shape,
dtype, extent and content hash: editing the index or the config after conversion is detected.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..formats.errors import CheckpointError

VERSION = 1
ALIGN = 4096  # every extent starts here; also O_DIRECT's alignment for offset, length and buffer
INDEX_NAME = "ftw.json"
MAGIC = "freetoken-ftw"

DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float8_e4m3fn,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
    )
}


class FtwError(CheckpointError):
    """An FTW folder we refuse to load (or cannot write); the message names the file."""


def dtype_name(dt: torch.dtype) -> str:
    name = str(dt).removeprefix("torch.")
    if name not in DTYPES:
        raise FtwError(f"dtype {dt} cannot be stored in FTW")
    return name


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Entry:
    """One tensor: ``model.<param>`` for dense parameters, ``experts.<bank>`` for expert banks."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    offset: int
    nbytes: int
    sha256: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class FtwIndex:
    version: int
    fingerprint: str
    expert_format: str
    files: dict[str, int]  # data file -> exact size in bytes
    tensors: tuple[Entry, ...]
    aux_files: tuple[str, ...]  # copied config / tokenizer / template files

    def to_json(self) -> str:
        d = asdict(self)
        d["tensors"] = [{**asdict(e), "shape": list(e.shape)} for e in self.tensors]
        return json.dumps({"magic": MAGIC, **d}, indent=1)


def fingerprint(config_bytes: bytes, entries: tuple[Entry, ...] | list[Entry]) -> str:
    """sha256 over config.json's bytes and each tensor's name/shape/dtype/extent/content hash."""
    h = hashlib.sha256(f"{MAGIC}/{VERSION}\n".encode())
    h.update(hashlib.sha256(config_bytes).digest())
    for e in entries:
        h.update(
            json.dumps(
                [e.name, list(e.shape), e.dtype, e.file, e.offset, e.nbytes, e.sha256]
            ).encode()
        )
    return h.hexdigest()


def _parse(path: Path) -> FtwIndex:
    try:
        raw: Any = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FtwError(f"{path}: unreadable index ({e})") from None
    if not isinstance(raw, dict) or raw.get("magic") != MAGIC:
        raise FtwError(f"{path}: not an FTW index")
    if raw.get("version") != VERSION:
        raise FtwError(
            f"{path}: FTW version {raw.get('version')!r} is not supported (this build reads {VERSION})"
        )
    try:
        entries = tuple(
            Entry(
                str(t["name"]),
                tuple(int(s) for s in t["shape"]),
                str(t["dtype"]),
                str(t["file"]),
                int(t["offset"]),
                int(t["nbytes"]),
                str(t["sha256"]),
            )
            for t in raw["tensors"]
        )
        return FtwIndex(
            version=VERSION,
            fingerprint=str(raw["fingerprint"]),
            expert_format=str(raw["expert_format"]),
            files={str(k): int(v) for k, v in raw["files"].items()},
            tensors=entries,
            aux_files=tuple(str(f) for f in raw.get("aux_files", ())),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise FtwError(f"{path}: malformed index ({type(e).__name__}: {e})") from None


def _check_entry(e: Entry, files: dict[str, int], path: Path) -> None:
    if e.dtype not in DTYPES:
        raise FtwError(f"{path}: tensor '{e.name}' has unsupported dtype {e.dtype!r}")
    if e.file not in files:
        raise FtwError(f"{path}: tensor '{e.name}' lives in unknown data file {e.file!r}")
    numel = torch.Size(e.shape).numel()
    if e.nbytes != numel * torch.empty((), dtype=e.torch_dtype).element_size():
        raise FtwError(
            f"{path}: tensor '{e.name}' has {e.nbytes} bytes, not shape {e.shape} x {e.dtype}"
        )
    if e.offset % ALIGN or e.offset < 0 or e.offset + align_up(e.nbytes) > files[e.file]:
        raise FtwError(
            f"{path}: tensor '{e.name}' extent [{e.offset}, +{e.nbytes}) is misaligned or past the end of {e.file}"
        )


def _check_overlaps(idx: FtwIndex, path: Path) -> None:
    by_file: dict[str, list[Entry]] = {}
    for e in idx.tensors:
        by_file.setdefault(e.file, []).append(e)
    for entries in by_file.values():
        entries.sort(key=lambda e: e.offset)
        for a, b in zip(entries, entries[1:], strict=False):
            if a.offset + a.nbytes > b.offset:
                raise FtwError(f"{path}: tensors '{a.name}' and '{b.name}' overlap")


def read_index(folder: str | Path) -> FtwIndex:
    """Parses and verifies ``folder/ftw.json`` against config.json and the data files' sizes.

    Raises FtwError when the index is missing (not an FTW folder, or an interrupted conversion),
    malformed, edited after conversion (fingerprint), or a data file is missing or truncated.
    Tensor contents are not re-hashed here (see ``verify_contents``)."""
    folder = Path(folder)
    path = folder / INDEX_NAME
    if not path.is_file():
        raise FtwError(
            f"{folder}: no {INDEX_NAME} (not an FTW checkpoint, or an unfinished conversion)"
        )
    idx = _parse(path)
    try:
        config_bytes = (folder / "config.json").read_bytes()
    except OSError as e:
        raise FtwError(f"{folder}: config.json unreadable ({e})") from None
    if fingerprint(config_bytes, idx.tensors) != idx.fingerprint:
        raise FtwError(
            f"{path}: fingerprint mismatch (the index or config.json changed after conversion)"
        )
    names = [e.name for e in idx.tensors]
    if len(set(names)) != len(names):
        raise FtwError(f"{path}: duplicate tensor names")
    for fname, size in idx.files.items():
        if "/" in fname or fname.startswith("."):
            raise FtwError(f"{path}: bad data file name {fname!r}")
        fpath = folder / fname
        if not fpath.is_file():
            raise FtwError(f"{fpath}: data file is missing")
        actual = fpath.stat().st_size
        if actual != size:
            raise FtwError(
                f"{fpath}: {actual} bytes, the index expects {size} (truncated or replaced)"
            )
    for entry in idx.tensors:
        _check_entry(entry, idx.files, path)
    _check_overlaps(idx, path)
    return idx
