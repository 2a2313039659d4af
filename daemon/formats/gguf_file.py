"""A GGUF reader (llama.cpp's single-file checkpoint format) that knows no model: the tensors'
data, read by ``GgufFile`` over a header parsed by ``gguf_header`` (whose names are re-exported
here: ``read_header``, ``GgufHeader``, ``GgufTensor``, ...). Tensor data is read with ``preadv``
straight into its destination instead of through a memory map, so pages of the file never stay
resident next to the loaded weights (one copy, as for safetensors).

A quantized tensor's raw blocks are kept reachable (``read_raw``) for kernels that compute on
them directly; ``read_float`` dequantizes (Q8_0, Q4_0, Q5_0 and the K-quants by
``gguf_dequant``, torch with the ``gguf`` package's values bit for bit; any other type by that
package's reference dequantizers) or reads F32/F16/BF16 as they are.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .gguf_dequant import DEQUANTIZERS
from .gguf_dequant import dequantize as dequantize_rows
from .gguf_header import (
    GGML_TYPES,
    GGUF_MAGIC,
    NATIVE_TYPES,
    GgufFormatError,
    GgufHeader,
    GgufTensor,
    ggml_type,
    is_gguf,
    read_header,
    read_headers,
    set_name,
    split_files,
)

__all__ = [
    "GGML_TYPES",
    "GGUF_MAGIC",
    "NATIVE",
    "GgufFile",
    "GgufFormatError",
    "GgufHeader",
    "GgufTensor",
    "can_dequantize",
    "ggml_type",
    "is_gguf",
    "read_header",
    "read_headers",
    "set_name",
    "split_files",
]

# Types read as they are; every other type is dequantized by ``read_float``.
NATIVE: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,  # integer tables (DeepSeek-V4's token id -> experts, ffn_gate_tid2eid)
}
assert set(NATIVE) == NATIVE_TYPES


def _workers() -> int:
    """Threads that dequantize a tensor at load: the cores this process may run on (at most
    8: the slices are short)."""
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        return max(1, min(8, os.cpu_count() or 1))


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
