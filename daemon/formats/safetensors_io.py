"""A minimal safetensors reader that reads each tensor straight into its destination.

The format: 8 bytes little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data, offsets relative to byte 8 + N. Reading with ``preadv`` into the destination tensor's own
memory (instead of mmap + copy) keeps the peak resident set at one copy of the weights: mapped
file pages would otherwise count as resident until the file is closed.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # microscaling exponents (DeepSeek-V4's FP8 / FP4 scales)
}
_MAX_HEADER = 100 << 20


class SafetensorsFormatError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first byte
    nbytes: int


class SafetensorsFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            self.tensors = self._header()
        except BaseException:
            os.close(self.fd)
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _header(self) -> dict[str, TensorInfo]:
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            raise SafetensorsFormatError("file shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsFormatError(f"header length {n} does not fit the file ({size} bytes)")
        try:
            meta = json.loads(os.pread(self.fd, n, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsFormatError(f"header is not valid JSON ({e})") from None
        if not isinstance(meta, dict):
            raise SafetensorsFormatError("header is not a JSON object")
        base, out = 8 + n, {}
        for name, info in meta.items():
            if name == "__metadata__":
                continue
            out[name] = self._entry(name, info, base, size)
        return out

    @staticmethod
    def _entry(name: str, info: object, base: int, size: int) -> TensorInfo:
        try:
            dtype = DTYPES[info["dtype"]]  # type: ignore[index]
            shape = tuple(int(s) for s in info["shape"])  # type: ignore[index]
            begin, end = (int(x) for x in info["data_offsets"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsFormatError(
                f"tensor '{name}': malformed header entry {info!r}"
            ) from None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes or begin < 0 or base + end > size:
            raise SafetensorsFormatError(
                f"tensor '{name}': data offsets [{begin}, {end}) do not match its shape/dtype or the file size"
            )
        return TensorInfo(name, dtype, shape, base + begin, nbytes)

    def read_into(self, info: TensorInfo, dest: torch.Tensor) -> None:
        """Reads the tensor's bytes into ``dest`` (contiguous, same dtype and element count)."""
        assert (
            dest.is_contiguous()
            and dest.dtype == info.dtype
            and dest.numel() == math.prod(info.shape)
        )
        view = dest.reshape(-1).view(torch.uint8).numpy().data if dest.numel() else memoryview(b"")
        done = 0
        while done < info.nbytes:
            got = os.preadv(self.fd, [view[done:]], info.offset + done)
            if got <= 0:
                raise SafetensorsFormatError(f"tensor '{info.name}': file ends early")
            done += got

    def read(self, info: TensorInfo) -> torch.Tensor:
        t = torch.empty(info.shape, dtype=info.dtype)
        self.read_into(info, t)
        return t
