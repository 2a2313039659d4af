"""The GGUF header (magic, version, metadata key/values, tensor table) parsed in one pass over its
bytes, with nothing heavier than the standard library: struct unpacks on a read-only map of the
file (``read_header``; a few tens of ms for a 150k-token vocabulary). The daemon parses the file
it serves before it imports torch (``formats.gguf_early``), and every later reader of the same
file takes the header parsed then (``read_header`` returns it while the file is unchanged).
``gguf_file`` reads the tensors' data.

Shapes are given in torch order (outermost first): GGUF lists ``ne0`` (the contiguous row length)
first, so ``[n_embd, n_vocab]`` in the file is ``(n_vocab, n_embd)`` here.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime.readahead import SPLIT_NAME, split_set

GGUF_MAGIC = b"GGUF"
# Types read as they are (``gguf_file.NATIVE`` gives their torch dtypes); every other type is
# dequantized by ``gguf_file.GgufFile.read_float``.
NATIVE_TYPES = frozenset({"F32", "F16", "BF16", "I32"})


# ggml type id -> (name, values a block, bytes a block): the tensor types of GGUF files, as the
# ``gguf`` package lists them (GGMLQuantizationType, GGML_QUANT_SIZES; tests/test_gguf_startup.py
# checks they agree). The header parse reads them here: importing that package costs ~0.2 s of
# CPU, and a start-up needs it only to dequantize a type ``gguf_dequant`` lacks.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
}  # fmt: skip


def ggml_type(qtype: int) -> tuple[str, int, int] | None:
    """(name, values a block, bytes a block) of ggml type id ``qtype``: ``GGML_TYPES``, else
    the ``gguf`` package's tables (types newer than ours), None where neither knows it."""
    known = GGML_TYPES.get(qtype)
    if known is not None:
        return known
    # deferred: gguf (the optional GGUF reader library)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(qtype)
    except ValueError:
        return None
    block, type_size = GGML_QUANT_SIZES[kind]
    return kind.name, block, type_size


class GgufFormatError(ValueError):
    """A file that is not a readable GGUF; the message names the file (and tensor)."""


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type_name: str  # ggml type: F32, BF16, Q8_0, Q4_K, MXFP4, ...
    ggml_type: int
    shape: tuple[int, ...]  # torch order: outermost first, the row (ne0) last
    offset: int  # absolute file offset of the first byte
    nbytes: int
    path: Path

    @property
    def quantized(self) -> bool:
        return self.type_name not in NATIVE_TYPES


def is_gguf(path: str | Path) -> bool:
    """True for a file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def split_files(path: str | Path) -> list[Path]:
    """All files of a split set ``name-0000i-of-0000N.gguf`` (given any of them), in order; a
    plain file alone."""
    p = Path(path)
    if SPLIT_NAME.match(p.name) is None:
        return [p]
    files = split_set(p)
    n = len(files)
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise GgufFormatError(f"{p}: split file {missing[0].name} of {n} is missing")
    return files


def set_name(path: str | Path) -> str:
    """A model name for a GGUF file: its stem without a split suffix (``-00001-of-00003``)."""
    p = Path(path)
    m = SPLIT_NAME.match(p.name)
    return m.group("stem") if m else p.stem


@dataclass(frozen=True)
class GgufHeader:
    """One GGUF file's parsed header: ``metadata`` (key -> Python value; the pseudo-keys
    ``GGUF.version``, ``GGUF.tensor_count`` and ``GGUF.kv_count`` included) and ``tensors``
    (name -> GgufTensor, absolute offsets), with the file's identity when it was read
    (``stat``: device, inode, size, mtime and ctime in ns) so that a holder can tell a changed
    file (``current``)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensor]
    stat: tuple[int, ...]

    def current(self) -> bool:
        """Whether the file at ``path`` is still the one parsed (same identity)."""
        try:
            return _identity(self.path) == self.stat
        except OSError:
            return False


def _identity(path: Path) -> tuple[int, ...]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# The headers parsed last (path -> header), returned again while their file is unchanged: one
# start-up reads a file's header in several places (the expert format, the bandwidth profile,
# the config, the weights, the tokenizer), each a parse of its whole vocabulary otherwise.
_PARSED: dict[Path, GgufHeader] = {}
_EXPERT_STACK = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


def expert_stacks(tensors: dict[str, GgufTensor]) -> dict[int, dict[str, GgufTensor]]:
    """{block number: {gate | up | down: tensor}} of a file's stacked expert weights."""
    out: dict[int, dict[str, GgufTensor]] = {}
    for name, t in tensors.items():
        m = _EXPERT_STACK.match(name)
        if m:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = t
    return out


_PARSED_KEEP = 2  # files: a split set's first ones, or a swap's old and new model


def read_header(path: str | Path) -> GgufHeader:
    """The header of one GGUF file (GgufFormatError naming the file when it cannot be parsed):
    parsed, or the one parsed before while the file is unchanged (``GgufHeader.current``)."""
    path = Path(path)
    done = _PARSED.get(path)
    if done is not None and done.current():
        return done
    header = _parse_file(path)
    _PARSED.pop(path, None)
    while len(_PARSED) >= _PARSED_KEEP:
        _PARSED.pop(next(iter(_PARSED)), None)
    _PARSED[path] = header
    return header


def _parse_file(path: Path) -> GgufHeader:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
            stat = _identity(path)
            if magic != GGUF_MAGIC:
                raise GgufFormatError(
                    f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})"
                )
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                try:
                    meta, infos = _parse_header(mm)
                except (ValueError, IndexError, KeyError, OverflowError, struct.error) as e:
                    raise GgufFormatError(
                        f"{path}: corrupt or unsupported GGUF header ({e or type(e).__name__})"
                    ) from None
    except OSError as e:
        raise GgufFormatError(f"{path}: cannot open ({e.strerror})") from None
    tensors: dict[str, GgufTensor] = {}
    for name, qtype, dims, offset in infos:
        if name in tensors:
            raise GgufFormatError(f"{path}: tensor '{name}' appears twice")
        tensors[name] = _entry(path, name, qtype, dims, offset, stat[2])
    _check_overlaps(path, tensors)
    return GgufHeader(path, meta, tensors, stat)


def read_headers(path: str | Path) -> list[GgufHeader]:
    """The parsed headers of a GGUF file, or of every file of its split set in order."""
    return [read_header(p) for p in split_files(path)]


def _entry(
    path: Path, name: str, qtype: int, dims: list[int], offset: int, size: int
) -> GgufTensor:
    known = ggml_type(qtype)
    if known is None:
        raise GgufFormatError(f"{path}: tensor '{name}' has unknown ggml type id {qtype}")
    type_name, block, type_size = known
    shape = tuple(int(x) for x in reversed(dims))
    if shape and shape[-1] % block:
        raise GgufFormatError(
            f"{path}: tensor '{name}' has rows of {shape[-1]} values, not a multiple "
            f"of the {block}-value blocks of type {type_name}"
        )
    nbytes = math.prod(shape) // block * type_size
    if offset + nbytes > size:
        raise GgufFormatError(
            f"{path}: tensor '{name}' ({type_name}{list(shape)}, {nbytes} bytes at "
            f"{offset}) runs past the end of the file ({size} bytes): truncated"
        )
    return GgufTensor(name, type_name, qtype, shape, offset, nbytes, path)


def _check_overlaps(path: Path, tensors: dict[str, GgufTensor]) -> None:
    """A type or shape that disagrees with the data's real size shows as a tensor running
    into the next one (GGUF stores no sizes, only offsets)."""
    ordered = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.offset + a.nbytes > b.offset:
            raise GgufFormatError(
                f"{path}: tensor '{a.name}' ({a.type_name}{list(a.shape)}, {a.nbytes} "
                f"bytes) does not fit before tensor '{b.name}': its size does not match its "
                "type and shape"
            )


# GGUF metadata value types: scalars by struct code, 8 a string, 9 an array
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32


def _parse_header(buf: mmap.mmap) -> tuple[dict[str, Any], list[tuple[str, int, list[int], int]]]:
    """(metadata, [(tensor name, ggml type id, dims as stored, absolute data offset)]) of the
    GGUF bytes ``buf``: llama.cpp's layout (gguf.c), either byte order. Metadata values are as
    the ``gguf`` package's ``ReaderField.contents()`` gives them: str (UTF-8, strict), int,
    float, bool, or a list of them (arrays of arrays flattened)."""
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version & 0xFFFF == 0:  # written on a big-endian host
        order, (version,) = ">", struct.unpack_from(">I", buf, 4)
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(f"file appears to be version {version}, which cannot be read")
    u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
    scalars = {k: struct.Struct(order + c) for k, c in _SCALARS.items()}
    n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
    size = len(buf)

    def string(pos: int) -> tuple[str, int]:
        (n,) = u64.unpack_from(buf, pos)
        end = pos + 8 + n
        if end > size:
            raise ValueError(f"a string of {n} bytes at {pos} runs past the end")
        return buf[pos + 8 : end].decode("utf-8"), end

    def strings(pos: int, count: int, out: list[Any]) -> int:
        # the vocabulary and merges: one pass, a slice and a decode per string
        unpack, append = u64.unpack_from, out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            append(buf[pos : pos + n].decode("utf-8"))
            pos += n
        if pos > size:
            raise ValueError("a string array runs past the end")
        return pos

    def value(kind: int, pos: int, out: list[Any] | None) -> tuple[Any, int]:
        if kind in scalars:
            sc = scalars[kind]
            (v,) = sc.unpack_from(buf, pos)
            return v, pos + sc.size
        if kind == _STRING:
            return string(pos)
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        (item,) = u32.unpack_from(buf, pos)
        (count,) = u64.unpack_from(buf, pos + 4)
        pos += 12
        items: list[Any] = [] if out is None else out  # arrays of arrays: one flat list
        if item in scalars:
            sc = scalars[item]
            if pos + count * sc.size > size:
                raise ValueError(f"an array of {count} values runs past the end")
            items.extend(struct.unpack_from(f"{order}{count}{_SCALARS[item]}", buf, pos))
            return items, pos + count * sc.size
        if item == _STRING:
            return items, strings(pos, count, items)
        if item != _ARRAY:
            raise ValueError(f"unknown metadata array type {item}")
        for _ in range(count):
            _, pos = value(_ARRAY, pos, items)
        return items, pos

    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors}
    meta["GGUF.kv_count"] = n_kv
    pos = 24
    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = u32.unpack_from(buf, pos)
        if key in meta:
            raise ValueError(f"duplicate metadata key {key!r}")
        meta[key], pos = value(kind, pos + 4, None)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = u32.unpack_from(buf, pos)
        dims = list(struct.unpack_from(f"{order}{n_dims}Q", buf, pos + 4))
        pos += 4 + 8 * n_dims
        (qtype,) = u32.unpack_from(buf, pos)
        (offset,) = u64.unpack_from(buf, pos + 4)
        pos += 12
        infos.append((name, qtype, dims, offset))
    align = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise ValueError(f"invalid alignment {align!r}: must be a power of two")
    data = -(-pos // align) * align
    return meta, [(n, q, d, data + off) for n, q, d, off in infos]
