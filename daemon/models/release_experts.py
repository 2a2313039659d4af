"""A release's per-expert quantized tensors (release_quant: compressed-tensors NVFP4 / INT4,
ModelOpt NVFP4) read into our packed expert banks, tensor by tensor, without dequantizing.

``nvfp4`` banks take the packed codes and the fp8 scales byte for byte and the global scale as
our multiplier (compressed-tensors' reciprocal, ModelOpt's as stored), gate and up each their
own. ``q4_0`` banks (GGUF blocks of 32: fp16 d, then 16 bytes whose byte j holds input j in the
low nibble and input j + 16 in the high one) take the INT4 nibbles moved into that order and the
group scales as each block's d, written in place into the block rows (the codes and the scales
arrive as separate tensors, in any order). The layouts are release_quant's docstring.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from ..experts.banks import ExpertBanks
from ..formats.errors import CheckpointError
from .release_quant import ReleaseQuant

# what each expert projection must have been given, per format (the loader's verify)
PARTS = {"nvfp4": ("packed", "scale", "global"), "q4_0": ("packed", "scale")}
# the checkpoint suffix of each part, per (method, format); activation scales: read past
_KINDS = {
    ("compressed-tensors", "nvfp4"): {
        "weight_packed": "packed",
        "weight_scale": "scale",
        "weight_global_scale": "global",
    },
    ("modelopt", "nvfp4"): {
        "weight": "packed",
        "weight_scale": "scale",
        "weight_scale_2": "global",
    },
    ("compressed-tensors", "q4_0"): {
        "weight_packed": "packed",
        "weight_scale": "scale",
        "weight_shape": "shape",
    },
}
ACTIVATION_SCALES = ("input_scale", "input_global_scale")  # activations stay unquantized here
KV_SCALES = (".k_scale", ".v_scale")  # ModelOpt's FP8 KV cache scales: our KV stays unquantized
KINDS = tuple(sorted({k for d in _KINDS.values() for k in d} | {"weight_zero_point"}))


class ReleaseExperts:
    """Fills ``banks`` (format ``rq.expert_format``) from one release tensor at a time."""

    def __init__(self, rq: ReleaseQuant, banks: ExpertBanks, hidden: int, inter: int) -> None:
        if banks.format != rq.expert_format:
            raise ValueError(f"banks are {banks.format}, the release {rq.expert_format}")
        if sys.byteorder != "little":  # the int32 words' nibble order is little-endian bytes
            raise CheckpointError("packed INT4 releases are read on little-endian hosts only")
        if hidden % rq.group_size or inter % rq.group_size:
            raise CheckpointError(
                f"{rq.method} groups of {rq.group_size} do not divide the experts' inputs "
                f"(hidden {hidden}, moe intermediate {inter})"
            )
        self.rq, self.banks, self.h, self.i = rq, banks, hidden, inter
        self.kinds = _KINDS[(rq.method, rq.expert_format)]
        self.ignored = 0  # activation scales read past

    def put(self, fid: int, proj: str, kind: str, src: Any, name: str, path: Path) -> str | None:
        """Reads tensor ``name`` (``kind``: its suffix, e.g. ``weight_packed``) of projection
        ``proj`` (gate_proj | up_proj | down_proj) of flat expert ``fid``; returns the part it
        filled, None for an activation scale (ignored)."""
        if kind in ACTIVATION_SCALES:
            self.ignored += 1
            return None
        part = self.kinds.get(kind)
        if part is None or (part == "packed" and src.dtype.is_floating_point):
            what = f"{self.rq.method} {self.rq.expert_format}: per projection " + ", ".join(
                f"'{k}'" for k in self.kinds
            )
            if src.dtype.is_floating_point and kind == "weight":
                left = "excluded by" if self.rq.excluded(name[: -len(".weight")]) else "not in"
                what += f" (a float routed expert, {left} the config's exclusions: mixed "
                what += "float / packed banks are not supported)"
            raise CheckpointError(f"{path}: unexpected tensor '{name}' (the experts are {what})")
        down = proj == "down_proj"
        rows, cols = (self.h, self.i) if down else (self.i, self.h)
        half = slice(0, self.i) if proj == "gate_proj" else slice(self.i, None)
        if down:
            half = slice(None)
        bank = "down" if down else "gate_up"
        if self.rq.expert_format == "nvfp4":
            self._nvfp4(part, src, rows, cols, fid, bank, half, proj, name, path)
        else:
            self._q4_0(part, src, rows, cols, fid, bank, half, name, path)
        return part

    def _nvfp4(
        self, part: str, src: Any, rows: int, cols: int, fid: int, bank: str, half: slice,
        proj: str, name: str, path: Path,
    ) -> None:  # fmt: skip
        b = self.banks
        if part == "packed":
            _expect(src, (torch.uint8,), (rows, cols // 2), name, path)
            src.into(getattr(b, bank)[fid, half])
        elif part == "scale":
            _expect(src, (torch.float8_e4m3fn,), (rows, cols // 16), name, path)
            src.into(b.extra[bank + "_scale"][fid, half])
        else:
            _expect(src, (torch.float32, torch.bfloat16, torch.float16), None, name, path)
            t = src.read().double().reshape(-1)
            if t.numel() != 1 or not (torch.isfinite(t).all() and t[0] > 0):
                raise CheckpointError(
                    f"{path}: tensor '{name}' must hold one finite positive global scale"
                )
            glob = 1.0 / t[0] if self.rq.method == "compressed-tensors" else t[0]
            col = 1 if proj == "up_proj" else 0
            b.extra[bank + "_global"][fid, col] = glob.float()

    def _q4_0(
        self, part: str, src: Any, rows: int, cols: int, fid: int, bank: str, half: slice,
        name: str, path: Path,
    ) -> None:  # fmt: skip
        blocks = getattr(self.banks, bank)[fid, half].view(rows, cols // 32, 18)
        if part == "shape":
            t = src.read()
            if t.dtype.is_floating_point or t.reshape(-1).tolist() != [rows, cols]:
                raise CheckpointError(
                    f"{path}: tensor '{name}' says {t.reshape(-1).tolist()}; expected "
                    f"[{rows}, {cols}]"
                )
        elif part == "packed":
            _expect(src, (torch.int32,), (rows, cols // 8), name, path)
            vals = int4_nibbles(src.read()).reshape(rows, cols // 32, 32)
            blocks[..., 2:] = vals[..., :16] | (vals[..., 16:] << 4)  # Q4_0's order
        else:
            _expect(src, (torch.bfloat16, torch.float16, torch.float32), None, name, path)
            group = self.rq.group_size
            s = src.read()
            if tuple(s.shape) != (rows, cols // group):
                raise CheckpointError(
                    f"{path}: tensor '{name}' has shape {list(s.shape)}; expected "
                    f"{[rows, cols // group]} (groups of {group})"
                )
            d = s.to(torch.float16)
            bad = d.float() != s.float()  # out of fp16's range, or finer than it (or NaN)
            if bad.any():
                v = float(s[bad][0])
                raise CheckpointError(
                    f"{path}: tensor '{name}' has a group scale {v!r} that fp16 (Q4_0's block "
                    "scale) does not hold exactly; this checkpoint cannot be kept packed as "
                    "q4_0 without rounding"
                )
            d = d.repeat_interleave(group // 32, dim=1)  # every block of a group: its scale
            blocks[..., :2] = d.contiguous().view(torch.uint8).reshape(rows, cols // 32, 2)


def int4_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' int32 words [R, W] -> the stored nibbles (q + 8) [R, 8W] uint8: value
    i of a row at bits 4i of its words, so on a little-endian host byte k holds value 2k in the
    low nibble and 2k + 1 in the high one."""
    by = packed.contiguous().view(torch.uint8)
    return torch.stack((by & 15, by >> 4), dim=-1).reshape(by.shape[0], -1)


def _expect(
    src: Any, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None, name: str, path: Path
) -> None:
    if src.dtype not in dtypes or (shape is not None and tuple(src.shape) != shape):
        want = " or ".join(str(d) for d in dtypes) + (str(list(shape)) if shape else "")
        raise CheckpointError(
            f"{path}: tensor '{name}' is {src.dtype}{list(src.shape)}; expected {want}"
        )
