"""A GGUF reader (llama.cpp's single-file checkpoint format) that knows no model.

Parsing of the header (magic, version, metadata key/values, tensor table) is the ``gguf``
package's, llama.cpp's own reader. Tensor data is read with ``preadv`` straight into its
destination instead of through the package's memory map, so pages of the file never stay
resident next to the loaded weights (one copy, as for safetensors).

Shapes are given in torch order (outermost first): GGUF lists ``ne0`` (the contiguous row length)
first, so ``[n_embd, n_vocab]`` in the file is ``(n_vocab, n_embd)`` here. A quantized tensor's raw
blocks are kept reachable (``read_raw``) for kernels that compute on them directly; ``read_float``
dequantizes (the ``gguf`` package's reference dequantizers) or reads F32/F16/BF16 as they are.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
# Types read as they are; every other type is dequantized by ``read_float``.
NATIVE: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


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
    m = _SPLIT.match(p.name)
    if m is None:
        return [p]
    n = int(m.group("n"))
    files = [p.with_name(f"{m.group('stem')}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise GgufFormatError(f"{p}: split file {missing[0].name} of {n} is missing")
    return files


def can_dequantize(type_name: str) -> bool:
    """Whether ``read_float`` can produce floats from this ggml type (probed on one block)."""
    # deferred: gguf (the optional GGUF reader library)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    # deferred: gguf (the optional GGUF reader library)
    from gguf.quants import dequantize

    if type_name in NATIVE:
        return True
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
    m = _SPLIT.match(p.name)
    return m.group("stem") if m else p.stem


class GgufFile:
    """One GGUF file: ``metadata`` (key -> Python value) and ``tensors`` (name -> GgufTensor)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise GgufFormatError(f"{self.path}: cannot open ({e.strerror})") from None
        if magic != GGUF_MAGIC:
            raise GgufFormatError(
                f"{self.path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})"
            )
        self.metadata, self.tensors = self._parse()
        self.fd = os.open(self.path, os.O_RDONLY)

    def _parse(self) -> tuple[dict[str, Any], dict[str, GgufTensor]]:
        try:
            reader = _HeaderReader(self.path)
        except (ValueError, IndexError, KeyError, OverflowError, TypeError, OSError) as e:
            raise GgufFormatError(
                f"{self.path}: corrupt or unsupported GGUF header ({e or type(e).__name__})"
            ) from None
        try:
            meta = {name: _value(field) for name, field in reader.fields.items()}
            size = self.path.stat().st_size
            tensors: dict[str, GgufTensor] = {}
            for name, qtype, dims, offset in reader.infos:
                if name in tensors:
                    raise GgufFormatError(f"{self.path}: tensor '{name}' appears twice")
                tensors[name] = self._entry(name, qtype, dims, offset, size)
            self._check_overlaps(tensors)
        finally:
            mm = getattr(reader.data, "_mmap", None)
            del reader
            if mm is not None:
                mm.close()
        return meta, tensors

    def _entry(self, name: str, qtype: int, dims: list[int], offset: int, size: int) -> GgufTensor:
        # deferred: gguf (the optional GGUF reader library)
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            kind = GGMLQuantizationType(qtype)
        except ValueError:
            raise GgufFormatError(
                f"{self.path}: tensor '{name}' has unknown ggml type id {qtype}"
            ) from None
        block, type_size = GGML_QUANT_SIZES[kind]
        shape = tuple(int(x) for x in reversed(dims))
        if shape and shape[-1] % block:
            raise GgufFormatError(
                f"{self.path}: tensor '{name}' has rows of {shape[-1]} values, not a multiple "
                f"of the {block}-value blocks of type {kind.name}"
            )
        nbytes = math.prod(shape) // block * type_size
        if offset + nbytes > size:
            raise GgufFormatError(
                f"{self.path}: tensor '{name}' ({kind.name}{list(shape)}, {nbytes} bytes at "
                f"{offset}) runs past the end of the file ({size} bytes): truncated"
            )
        return GgufTensor(name, kind.name, int(kind), shape, offset, nbytes, self.path)

    def _check_overlaps(self, tensors: dict[str, GgufTensor]) -> None:
        """A type or shape that disagrees with the data's real size shows as a tensor running
        into the next one (GGUF stores no sizes, only offsets)."""
        ordered = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(ordered, ordered[1:], strict=False):
            if a.offset + a.nbytes > b.offset:
                raise GgufFormatError(
                    f"{self.path}: tensor '{a.name}' ({a.type_name}{list(a.shape)}, {a.nbytes} "
                    f"bytes) does not fit before tensor '{b.name}': its size does not match its "
                    "type and shape"
                )

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

    def read_into(self, t: GgufTensor, dest: torch.Tensor, offset: int = 0) -> None:
        """Reads a native-type tensor's bytes [offset, offset + dest's size) straight into
        ``dest`` (contiguous, same dtype)."""
        assert not t.quantized and dest.is_contiguous() and dest.dtype == NATIVE[t.type_name]
        nbytes = dest.numel() * dest.element_size()
        assert offset + nbytes <= t.nbytes
        self._pread(t, dest, offset, nbytes)

    def read_float(self, t: GgufTensor) -> torch.Tensor:
        """The tensor in its own float dtype (F32/F16/BF16) or dequantized to float32."""
        if not t.quantized:
            out = torch.empty(t.shape, dtype=NATIVE[t.type_name])
            self._pread(t, out)
            return out
        # deferred: gguf (the optional GGUF reader library)
        from gguf import GGMLQuantizationType

        # deferred: gguf (the optional GGUF reader library)
        from gguf.quants import dequantize

        raw = self.read_raw(t).numpy()
        try:
            vals = dequantize(raw, GGMLQuantizationType(t.ggml_type))
        except NotImplementedError:
            raise GgufFormatError(
                f"{self.path}: tensor '{t.name}' has type {t.type_name}, which this build cannot "
                "dequantize"
            ) from None
        return torch.from_numpy(np.ascontiguousarray(vals, dtype=np.float32)).view(t.shape)

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


def _header_reader() -> type:
    # deferred: gguf (the optional GGUF reader library)
    import gguf

    class HeaderReader(gguf.GGUFReader):  # type: ignore[misc]
        """llama.cpp's reader, stopping at the tensor table: tensor data is not mapped here,
        so a truncated file is reported per tensor by ``GgufFile`` rather than as a numpy
        error."""

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            self.infos = []
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                self.infos.append(
                    (
                        bytes(name).decode("utf-8", "replace"),
                        int(raw_type[0]),
                        [int(d) for d in dims],
                        int(start_offs + offset[0]),
                    )
                )
            self.tensors = []

    return HeaderReader


def _HeaderReader(path: Path) -> Any:  # noqa: N802 (a class built on first use)
    return _header_reader()(path, "r")


def _value(field: Any) -> Any:
    """A metadata value as Python: str, int, float, bool or a list of them."""
    # deferred: gguf (the optional GGUF reader library)
    from gguf import GGUFValueType

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        return list(field.contents())
    return field.contents()
