"""A GGUF reader (llama.cpp's single-file checkpoint format) that knows no model.

The header (magic, version, metadata key/values, tensor table) is parsed here, in one pass over
its bytes (``read_header``: struct unpacks on a read-only map of the file, a few tens of ms for a
150k-token vocabulary where the ``gguf`` package's reader, a numpy view per value, took seconds);
a ``GgufHeader`` can be parsed once and handed to every later reader of the same file
(``GgufFile(path, header)``). Tensor data is read with ``preadv`` straight into its destination
instead of through a memory map, so pages of the file never stay resident next to the loaded
weights (one copy, as for safetensors).

Shapes are given in torch order (outermost first): GGUF lists ``ne0`` (the contiguous row length)
first, so ``[n_embd, n_vocab]`` in the file is ``(n_vocab, n_embd)`` here. A quantized tensor's raw
blocks are kept reachable (``read_raw``) for kernels that compute on them directly; ``read_float``
dequantizes (Q8_0, Q4_0, Q5_0 and the K-quants by ``gguf_dequant``, torch with the ``gguf``
package's values bit for bit; any other type by that package's reference dequantizers) or reads
F32/F16/BF16 as they are.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..runtime.readahead import SPLIT_NAME, split_set
from .gguf_dequant import DEQUANTIZERS
from .gguf_dequant import dequantize as dequantize_rows

GGUF_MAGIC = b"GGUF"
# Types read as they are; every other type is dequantized by ``read_float``.
NATIVE: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,  # integer tables (DeepSeek-V4's token id -> experts, ffn_gate_tid2eid)
}


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
        return self.type_name not in NATIVE


def _workers() -> int:
    """Threads that dequantize a tensor at load: the cores this process may run on (at most
    8: the slices are short)."""
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        return max(1, min(8, os.cpu_count() or 1))


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


def can_dequantize(type_name: str) -> bool:
    """Whether ``read_float`` can produce floats from this ggml type (probed on one block)."""
    if type_name in NATIVE or type_name in DEQUANTIZERS:  # ours: no need of the package
        return True
    # deferred: gguf (the optional GGUF reader library)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    # deferred: gguf (the optional GGUF reader library)
    from gguf.quants import dequantize

    kind = GGMLQuantizationType[type_name]
    _, type_size = GGML_QUANT_SIZES[kind]
    try:
        dequantize(np.zeros((1, type_size), np.uint8), kind)
    except NotImplementedError:
        return False
    return True


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


class GgufFile:
    """One GGUF file: ``metadata`` (key -> Python value) and ``tensors`` (name -> GgufTensor);
    ``header``: the file's header parsed before (``read_header``), used when it is this path's
    and the file is unchanged, else parsed again."""

    def __init__(self, path: str | Path, header: GgufHeader | None = None) -> None:
        self.path = Path(path)
        if header is None or header.path != self.path or not header.current():
            header = read_header(self.path)
        self.header = header
        self.metadata, self.tensors = header.metadata, header.tensors
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise GgufFormatError(f"{self.path}: cannot open ({e.strerror})") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> GgufFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_raw(self, t: GgufTensor) -> torch.Tensor:
        """The tensor's bytes as stored (quantized blocks included): uint8 [rows..., row_bytes]."""
        out = torch.empty(t.nbytes, dtype=torch.uint8)
        self._pread(t, out)
        rows = t.shape[:-1]
        return out.view(*rows, -1) if rows else out

    def read_raw_into(self, t: GgufTensor, dest: torch.Tensor, offset: int = 0) -> None:
        """Reads the tensor's stored bytes [offset, offset + dest's size) straight into ``dest``
        (contiguous uint8): a part of a quantized tensor with no copy of the whole."""
        assert dest.is_contiguous() and dest.dtype == torch.uint8
        assert offset + dest.numel() <= t.nbytes
        self._pread(t, dest, offset, dest.numel())

    def read_raw_scatter(self, t: GgufTensor, dests: list[torch.Tensor], offset: int = 0) -> None:
        """Reads the tensor's stored bytes from ``offset`` on into ``dests`` (contiguous uint8
        each) one after the other, in one ``preadv`` where the kernel reads it whole: adjacent
        parts of the file into buffers that are not adjacent."""
        views = [d.reshape(-1).numpy().data for d in dests if d.numel()]
        total = sum(v.nbytes for v in views)
        assert all(d.is_contiguous() and d.dtype == torch.uint8 for d in dests)
        assert offset + total <= t.nbytes
        at = t.offset + offset
        while views:
            got = os.preadv(self.fd, views, at)
            if got <= 0:
                raise GgufFormatError(f"{self.path}: tensor '{t.name}': file ends early")
            at += got
            while views and got >= views[0].nbytes:  # drop the buffers filled
                got -= views[0].nbytes
                views.pop(0)
            if views and got:
                views[0] = views[0][got:]

    def read_into(self, t: GgufTensor, dest: torch.Tensor, offset: int = 0) -> None:
        """Reads a native-type tensor's bytes [offset, offset + dest's size) straight into
        ``dest`` (contiguous, same dtype)."""
        assert not t.quantized and dest.is_contiguous() and dest.dtype == NATIVE[t.type_name]
        nbytes = dest.numel() * dest.element_size()
        assert offset + nbytes <= t.nbytes
        self._pread(t, dest, offset, nbytes)

    def read_float(self, t: GgufTensor) -> torch.Tensor:
        """The tensor in its own dtype (F32/F16/BF16, an I32 table) or dequantized to float32."""
        if not t.quantized:
            out = torch.empty(t.shape, dtype=NATIVE[t.type_name])
            self._pread(t, out)
            return out
        # deferred: gguf (the optional GGUF reader library)
        from gguf import GGMLQuantizationType

        # deferred: gguf (the optional GGUF reader library)
        from gguf.quants import dequantize

        if t.type_name in DEQUANTIZERS and len(t.shape) >= 2:  # ours: the same values, faster
            out = torch.empty(t.shape, dtype=torch.float32)
            self.read_float_into(t, out)
            return out
        raw = self.read_raw(t).numpy()
        try:
            vals = dequantize(raw, GGMLQuantizationType(t.ggml_type))
        except NotImplementedError:
            raise GgufFormatError(
                f"{self.path}: tensor '{t.name}' has type {t.type_name}, which this build cannot "
                "dequantize"
            ) from None
        return torch.from_numpy(np.ascontiguousarray(vals, dtype=np.float32)).view(t.shape)

    def read_float_into(
        self, t: GgufTensor, dest: torch.Tensor, chunk_bytes: int | None = None
    ) -> None:
        """``read_float``'s values written into ``dest`` (contiguous, t's shape, any float dtype:
        converted as ``copy_`` converts), a quantized tensor dequantized a slice of rows at a
        time through reused buffers: no file-sized float32 temporary to fault in and copy out
        (the same values: blocks dequantize independently)."""
        assert dest.is_contiguous() and tuple(dest.shape) == t.shape
        if not t.quantized or len(t.shape) < 2:
            dest.copy_(self.read_float(t))
            return
        rows, row_len = math.prod(t.shape[:-1]), t.shape[-1]
        row_bytes = t.nbytes // rows
        if t.type_name in DEQUANTIZERS:
            self._dequantize_into(t, dest.view(rows, row_len), row_bytes, chunk_bytes or 512 << 10)
            return
        # deferred: gguf (the optional GGUF reader library)
        from gguf import GGMLQuantizationType

        # deferred: gguf (the optional GGUF reader library)
        from gguf.quants import dequantize

        step = max(1, (chunk_bytes or 8 << 20) // row_bytes)
        flat = dest.view(rows, row_len)
        buf = torch.empty(min(step, rows) * row_bytes, dtype=torch.uint8)
        kind = GGMLQuantizationType(t.ggml_type)
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            raw = buf[: n * row_bytes]
            self._pread(t, raw, r0 * row_bytes, n * row_bytes)
            try:
                vals = dequantize(raw.view(n, row_bytes).numpy(), kind)
            except NotImplementedError:
                raise GgufFormatError(
                    f"{self.path}: tensor '{t.name}' has type {t.type_name}, which this build "
                    "cannot dequantize"
                ) from None
            flat[r0 : r0 + n].copy_(torch.from_numpy(np.ascontiguousarray(vals, np.float32)))

    def _dequantize_into(
        self, t: GgufTensor, flat: torch.Tensor, row_bytes: int, chunk_bytes: int
    ) -> None:
        """``read_float_into`` by our torch dequantizers (``gguf_dequant``: the gguf package's
        values bit for bit), in slices of rows small enough that the fp32 slice is still in cache
        when it is converted into ``flat`` (written straight into it when ``flat`` is fp32), on
        ``_workers`` threads that each take every n-th slice and run torch on themselves alone
        (``set_num_threads(1)`` is per thread): a parallel region per small op cost more than
        it gained, and far more while another process held a core."""
        rows, row_len = flat.shape
        step = max(1, chunk_bytes // row_bytes)
        starts = range(0, rows, step)
        workers = min(_workers(), len(starts))

        def work(first: int) -> None:
            if workers > 1:
                torch.set_num_threads(1)  # this thread's OpenMP and MKL only
            buf = torch.empty(min(step, rows) * row_bytes, dtype=torch.uint8)
            direct = flat.dtype == torch.float32
            vals = None if direct else torch.empty(min(step, rows), row_len, dtype=torch.float32)
            for r0 in starts[first::workers]:
                n = min(step, rows - r0)
                raw = buf[: n * row_bytes]
                self._pread(t, raw, r0 * row_bytes, n * row_bytes)
                if vals is None:
                    dequantize_rows(raw.view(n, row_bytes), t.type_name, flat[r0 : r0 + n])
                else:
                    dequantize_rows(raw.view(n, row_bytes), t.type_name, vals[:n])
                    flat[r0 : r0 + n].copy_(vals[:n])

        if workers <= 1:
            work(0)
            return
        with ThreadPoolExecutor(workers) as pool:
            for f in [pool.submit(work, k) for k in range(workers)]:
                f.result()

    def _pread(
        self, t: GgufTensor, dest: torch.Tensor, offset: int = 0, nbytes: int | None = None
    ) -> None:
        nbytes = t.nbytes if nbytes is None else nbytes
        flat = dest.reshape(-1).view(torch.uint8)  # a view: dest is contiguous
        view = flat.numpy().data if dest.numel() else memoryview(b"")
        done = 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], t.offset + offset + done)
            if got <= 0:
                raise GgufFormatError(f"{self.path}: tensor '{t.name}': file ends early")
            done += got


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
