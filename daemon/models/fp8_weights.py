"""Fine-grained FP8 dense weights in an HF checkpoint (``quantization_config.quant_method: fp8``,
DeepSeek-V3 / V4's releases, transformers' ``FineGrainedFP8Config``), widened to the model's
float dtype at load: there is no dense FP8 kernel, so the dense path computes them as floats.

A weight ``X.weight`` stored as float8_e4m3fn comes with its scales under ``X.scale`` (DeepSeek's
release) or ``X.weight_scale_inv`` (transformers' name): one per block of ``weight_block_size``
(default 128 x 128; rows = outputs, cols = inputs), ``[ceil(rows / 128), ceil(cols / 128)]``,
a partial block at the edges. The stored weight is ``q * scale``. Scales are float32 (V3) or
ue8m0 (``scale_fmt: ue8m0``, V4: float8_e8m0fnu, a bare power of two 2^(e - 127); a uint8 tensor
is read as the same exponents).

The pairs are found across shards before the tensors are read (`Fp8Scales.find`); the scales
(1 / 16384 of their weights' elements) are read then, the weights one by one in the loader's
pass, each widened a block-row at a time into its destination (no second full copy).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from ..formats.errors import CheckpointError
from ..formats.safetensors_io import SafetensorsFile, SafetensorsFormatError, TensorInfo

FP8 = torch.float8_e4m3fn
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu, torch.uint8)


class Source(Protocol):
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self) -> torch.Tensor: ...

    def into(self, dest: torch.Tensor) -> None: ...


def block_size(raw: dict[str, Any]) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of config.json (default 128 x 128)."""
    q = raw.get("quantization_config") or {}
    bs = q.get("weight_block_size") if isinstance(q, dict) else None
    if bs is None:
        return 128, 128
    if not (
        isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)
    ):
        raise CheckpointError(
            f"quantization_config.weight_block_size = {bs!r}: expected [rows, cols]"
        )
    return bs[0], bs[1]


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as float32 multipliers (e8m0 / uint8: 2^(e - 127))."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def widen(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    out: torch.Tensor,
) -> torch.Tensor:
    """``out`` [rows, cols] (any float dtype) = the FP8 ``weight`` times its block ``scale``,
    filled one block-row at a time (float32 arithmetic)."""
    rows, cols = weight.shape
    bm, bn = block
    s = scale_values(scale)
    for i in range(s.shape[0]):
        r = slice(i * bm, min(rows, (i + 1) * bm))
        per_col = s[i].repeat_interleave(bn)[:cols]
        out[r].copy_(weight[r].float() * per_col)
    return out


class Widened:
    """An FP8 weight of the checkpoint with its scales, read as a float tensor (the loader's
    source interface: ``shape``, ``dtype``, ``read``, ``into``)."""

    def __init__(
        self, src: Source, scale: torch.Tensor, block: tuple[int, int], name: str, path: Path
    ) -> None:
        self.src, self.scale, self.block = src, scale, block
        self.shape, self.dtype = tuple(src.shape), torch.float32
        rows, cols = self.shape if len(self.shape) == 2 else (0, 0)
        want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        if len(self.shape) != 2 or tuple(scale.shape) != want:
            raise CheckpointError(
                f"{path}: FP8 tensor '{name}' {list(self.shape)} has scales "
                f"{list(scale.shape)}; expected {list(want)} for blocks of {list(block)}"
            )
        self.widened_bytes = 0  # what the float copy took (the loader's log line)

    def read(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=torch.float32)
        self.into(out)
        return out

    def into(self, dest: torch.Tensor) -> None:
        widen(self.src.read(), self.scale, self.block, dest)
        self.widened_bytes += dest.numel() * dest.element_size()


def tensor_index(files: Iterable[Path]) -> dict[str, tuple[Path, TensorInfo]]:
    """{tensor name: (its shard, its header entry)} over all shards (headers only)."""
    where: dict[str, tuple[Path, TensorInfo]] = {}
    for path in files:
        try:
            with SafetensorsFile(path) as f:
                where.update((n, (path, i)) for n, i in f.tensors.items())
        except (SafetensorsFormatError, OSError) as e:
            raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({e})") from None
    return where


class Fp8Scales:
    """The block scales of a checkpoint's FP8 weights, keyed by the weight's name."""

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block
        self.by_weight: dict[str, torch.Tensor] = {}
        self.scale_names: set[str] = set()
        self.widened: list[Widened] = []  # the weights read through ``wrap``

    @classmethod
    def find(cls, files: Iterable[Path], block: tuple[int, int], skip: Any = None) -> Fp8Scales:
        """Pairs every float8_e4m3fn ``X.weight`` with its ``X.scale`` / ``X.weight_scale_inv``
        over all shards (``skip(name)``: tensors the loader does not load) and reads the
        scales."""
        out = cls(block)
        where = tensor_index(files)
        wanted: dict[Path, list[tuple[str, TensorInfo]]] = {}
        for name, (path, info) in where.items():
            if info.dtype != FP8 or not name.endswith(".weight") or (skip and skip(name)):
                continue
            base = name[: -len(".weight")]
            found = [base + s for s in SCALE_SUFFIXES if base + s in where]
            if not found:
                raise CheckpointError(
                    f"{path}: FP8 tensor '{name}' has no block scales ('{base}.scale' or "
                    f"'{base}.weight_scale_inv')"
                )
            spath, sinfo = where[found[0]]
            if sinfo.dtype not in _SCALE_DTYPES:
                raise CheckpointError(
                    f"{spath}: scale tensor '{found[0]}' has dtype {sinfo.dtype}; expected "
                    "float32 or ue8m0 (float8_e8m0fnu)"
                )
            wanted.setdefault(spath, []).append((name, sinfo))
            out.scale_names.add(found[0])
        for spath, items in wanted.items():
            with SafetensorsFile(spath) as f:
                for name, sinfo in items:
                    out.by_weight[name] = f.read(sinfo)
        return out

    def wrap(self, name: str, src: Source, path: Path) -> Widened:
        """The FP8 weight ``name`` (``src``) as a float source."""
        w = Widened(src, self.by_weight[name], self.block, name, path)
        self.widened.append(w)
        return w

    def summary(self) -> str | None:
        """One line: how many FP8 weights were widened and the RAM that took over the FP8
        bytes (None when there were none)."""
        if not self.widened:
            return None
        gib = 1 << 30
        stored = sum(
            math.prod(w.shape) + w.scale.numel() * w.scale.element_size() for w in self.widened
        )
        now = sum(w.widened_bytes for w in self.widened)
        return (
            f"{len(self.widened)} FP8 dense weights ({stored / gib:.3f} GiB with their block "
            f"scales) widened at load to {now / gib:.3f} GiB: +{(now - stored) / gib:.3f} GiB of "
            "RAM (no dense FP8 kernel)"
        )
