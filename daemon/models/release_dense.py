"""A release's quantized dense weights (release_quant: NVFP4 / INT4 linears other than the routed
experts, e.g. the shared experts and dense MLPs that ModelOpt exports quantize unless excluded),
widened to float at load as FP8 dense weights are (fp8_weights): there is no dense NVFP4 / INT4
kernel, so the dense path computes them as floats. The routed experts stay packed
(release_experts).

A packed weight (compressed-tensors ``X.weight_packed``; ModelOpt ``X.weight`` stored uint8)
comes with its sidecars: ``X.weight_scale`` and the global scale (``X.weight_global_scale``, the
divisor / ``X.weight_scale_2``, the multiplier) for NVFP4, ``X.weight_scale`` and
``X.weight_shape`` for INT4; ``X.input_scale`` / ``X.input_global_scale`` are ignored
(activations are not quantized here). They are paired across shards before the weights are
read (``DenseScales.find``); the weights are widened one by one in the loader's pass. The
values: NVFP4 code * scale * global (the same global multiplier the expert banks hold), INT4
(nibble - 8) * scale, in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ..experts.microscale import nv_dequant
from ..formats.errors import CheckpointError
from ..formats.safetensors_io import SafetensorsFile, TensorInfo
from .fp8_weights import Source, tensor_index
from .release_experts import int4_nibbles
from .release_quant import ReleaseQuant

# per (method, format): the packed weight's suffix and dtype, and its sidecars' suffixes by role
_LAYOUT: dict[tuple[str, str], tuple[str, torch.dtype, dict[str, str]]] = {
    ("compressed-tensors", "nvfp4"): (
        "weight_packed",
        torch.uint8,
        {"scale": "weight_scale", "global": "weight_global_scale"},
    ),
    ("modelopt", "nvfp4"): (
        "weight",
        torch.uint8,
        {"scale": "weight_scale", "global": "weight_scale_2"},
    ),
    ("compressed-tensors", "q4_0"): (
        "weight_packed",
        torch.int32,
        {"scale": "weight_scale", "shape": "weight_shape"},
    ),
}
_ACTIVATION = ("input_scale", "input_global_scale")


class WidenedPacked:
    """A packed dense weight with its sidecars, read as a float32 tensor (the loader's source
    interface: ``shape``, ``dtype``, ``read``, ``into``)."""

    def __init__(
        self, rq: ReleaseQuant, src: Source, side: dict[str, torch.Tensor], name: str, path: Path
    ) -> None:
        self.rq, self.src, self.side = rq, src, side
        rows, packed = src.shape if len(src.shape) == 2 else (0, 0)
        per = 2 if rq.expert_format == "nvfp4" else 8  # values per stored element
        cols = packed * per
        if "shape" in side:
            shape = side["shape"].reshape(-1).tolist()
            if shape[:1] != [rows] or len(shape) != 2 or not cols - per < shape[1] <= cols:
                raise CheckpointError(
                    f"{path}: tensor '{name}' {list(src.shape)} does not hold weight_shape {shape}"
                )
            cols = int(shape[1])
        group = rq.group_size
        want = (rows, math.ceil(cols / group))
        if rows == 0 or cols % group or tuple(side["scale"].shape) != want:
            raise CheckpointError(
                f"{path}: packed tensor '{name}' {list(src.shape)} has scales "
                f"{list(side['scale'].shape)}; expected {list(want)} (groups of {group})"
            )
        self.shape: tuple[int, ...] = (rows, cols)
        self.dtype = torch.float32
        self.widened_bytes = 0

    def read(self) -> torch.Tensor:
        packed = self.src.read()
        scale = self.side["scale"]
        if self.rq.expert_format == "nvfp4":
            g = self.side["global"].double().reshape(-1)[0]
            glob = (1.0 / g if self.rq.method == "compressed-tensors" else g).float()
            return nv_dequant(packed, scale, glob)
        q = int4_nibbles(packed)[:, : self.shape[1]]
        return (q.float() - 8) * scale.float().repeat_interleave(self.rq.group_size, dim=1)

    def into(self, dest: torch.Tensor) -> None:
        dest.copy_(self.read())
        self.widened_bytes += dest.numel() * dest.element_size()


class DenseScales:
    """The sidecars of a release's packed dense weights, keyed by the packed weight's name."""

    def __init__(self, rq: ReleaseQuant | None) -> None:
        self.rq = rq
        self.by_weight: dict[str, dict[str, torch.Tensor]] = {}
        self.sidecars: set[str] = set()  # read here, or ignored: the loader passes them by
        self.widened: list[WidenedPacked] = []

    @classmethod
    def find(
        cls, files: Iterable[Path], rq: ReleaseQuant | None, skip: Callable[[str], bool]
    ) -> DenseScales:
        """Pairs every packed dense weight (``skip(name)``: tensors read elsewhere or not at
        all, the routed experts among them) with its sidecars over all shards, and reads
        them."""
        out = cls(rq)
        if rq is None:
            return out
        suffix, dtype, roles = _LAYOUT[(rq.method, rq.expert_format)]
        where = tensor_index(files)
        wanted: dict[Path, list[tuple[str, str, str, TensorInfo]]] = {}
        for name, (path, info) in where.items():
            if not name.endswith("." + suffix) or info.dtype != dtype or skip(name):
                continue
            base = name[: -len(suffix)]
            for role, s in roles.items():
                if base + s not in where:
                    raise CheckpointError(
                        f"{path}: packed tensor '{name}' ({rq.method} {rq.expert_format}) has "
                        f"no '{base + s}'"
                    )
                spath, sinfo = where[base + s]
                wanted.setdefault(spath, []).append((name, role, base + s, sinfo))
            out.by_weight[name] = {}
            out.sidecars.update(base + s for s in roles.values())
            out.sidecars.update(base + s for s in _ACTIVATION if base + s in where)
        for spath, items in wanted.items():
            with SafetensorsFile(spath) as f:
                for name, role, _, sinfo in items:
                    out.by_weight[name][role] = f.read(sinfo)
        return out

    def weight_name(self, name: str) -> str:
        """The float weight's name of packed weight ``name`` (``X.weight_packed`` -> ``X.weight``)."""
        assert self.rq is not None
        suffix = _LAYOUT[(self.rq.method, self.rq.expert_format)][0]
        return name[: -len(suffix)] + "weight"

    def wrap(self, name: str, src: Source, path: Path) -> WidenedPacked:
        assert self.rq is not None
        w = WidenedPacked(self.rq, src, self.by_weight[name], name, path)
        self.widened.append(w)
        return w

    def summary(self) -> str | None:
        """One line: how many packed dense weights were widened, and the RAM it took."""
        if not self.widened:
            return None
        gib = 1 << 30
        stored = sum(
            math.prod(w.src.shape) * w.src.dtype.itemsize
            + sum(t.numel() * t.element_size() for t in w.side.values())
            for w in self.widened
        )
        now = sum(w.widened_bytes for w in self.widened)
        assert self.rq is not None
        return (
            f"{len(self.widened)} packed dense weights ({self.rq.expert_format}, "
            f"{stored / gib:.3f} GiB with their scales) widened at load to {now / gib:.3f} GiB: "
            f"+{(now - stored) / gib:.3f} GiB of RAM (no dense {self.rq.expert_format} kernel)"
        )
