"""NVFP4 tensors in GGUF files (llama.cpp's converter): their global scales and the stacked
experts' packed load.

The converter writes an NVFP4 weight's global scale beside it as ``<weight>.scale`` (the
multiplier: ModelOpt's ``weight_scale_2``; it takes the reciprocal of compressed-tensors'
divisor), and leaves it out where it is 1; ``<weight>.input_scale`` is the activations' scale,
unused here (activations stay unquantized, as for the checkpoints' own NVFP4 experts,
``release_experts``). Stacked experts load packed into ``nvfp4`` banks (``gguf_experts.NvStack``);
a dense NVFP4 weight dequantizes at load, times its global.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from ..experts.banks import ExpertBanks
from ..formats.errors import CheckpointError
from ..formats.gguf_file import GgufFile, GgufTensor
from . import gguf_experts
from .config import ModelConfig
from .fill import Filler, proj_rows
from .gguf_arch import Fix

EXPS_SCALE = re.compile(r"^ffn_(gate|up|down)_exps\.(scale|input_scale)$")
_SUFFIXES = (".scale", ".input_scale")

Tensors = Mapping[str, tuple[GgufFile, GgufTensor]]


def scale_of(tensors: Tensors, name: str) -> str | None:
    """The NVFP4 weight (stacked experts or dense) whose global scale or activation scale
    ``name`` is; None if it is not one (other families have tensors of such names: Gemma-4's
    per-expert down scale ``ffn_down_exps.scale``)."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            weight = name.removesuffix(suffix) + ".weight"
            if weight in tensors and tensors[weight][1].type_name == "NVFP4":
                return weight
    return None


def dense_global(tensors: Tensors, name: str, t: GgufTensor) -> float | None:
    """A dense NVFP4 weight's global scale; None where ``t`` is not NVFP4 or has none (1)."""
    scale = name.removesuffix(".weight") + ".scale"
    if t.type_name != "NVFP4" or scale not in tensors:
        return None
    f, st = tensors[scale]
    v = f.read_float(st).double().reshape(-1)
    if v.numel() != 1 or not (torch.isfinite(v).all() and v[0] > 0):
        raise CheckpointError(f"{st.path}: tensor '{scale}' must hold one finite positive scale")
    return float(v[0])


def scaled(fix: Fix | None, scale: float) -> Fix:
    """``fix`` after multiplying by ``scale`` (a dense NVFP4 weight's global scale)."""

    def apply(w: torch.Tensor) -> torch.Tensor:
        w = w * scale
        return w if fix is None else fix(w)

    return apply


def experts_global(
    cfg: ModelConfig,
    banks: ExpertBanks,
    filler: Filler,
    layer: int,
    key: str,
    vals: torch.Tensor,
    name: str,
    path: Path,
    nv: bool,
) -> None:
    """A stacked NVFP4 expert weight's per-expert global scale (``key``
    ``ffn_<proj>_exps.scale``, [E] in ``vals``) into the banks' globals; ``.input_scale`` is
    skipped. ``nv``: the load keeps NVFP4 experts (every MoE layer's are NVFP4)."""
    proj, kind = key.removeprefix("ffn_").split("_exps.")
    if not nv:
        raise CheckpointError(
            f"{path}: tensor '{name}': NVFP4 experts load only where every MoE layer's "
            "gate, up and down experts are NVFP4 (into nvfp4 banks; not mixed with other types)"
        )
    if kind == "input_scale":
        return
    e = cfg.num_experts
    vals = vals.double().reshape(-1)
    if vals.numel() != e or not (torch.isfinite(vals).all() and (vals > 0).all()):
        raise CheckpointError(
            f"{path}: tensor '{name}' must hold {e} finite positive scales (one an expert)"
        )
    base = filler.moe_base(layer, name, path)
    if proj == "down":
        banks.extra["down_global"][base : base + e, 0] = vals.float()
    else:
        banks.extra["gate_up_global"][base : base + e, int(proj == "up")] = vals.float()


def experts_stack(
    cfg: ModelConfig,
    banks: ExpertBanks,
    filler: Filler,
    layer: int,
    proj: str,
    f: GgufFile,
    t: GgufTensor,
    name: str,
    pool: gguf_experts.FillPool | None,
) -> None:
    """NVFP4 codes and scales of ``layer``'s stacked ``proj`` experts into the nvfp4 banks,
    packed (``pool``: the fill's reader threads, or None)."""
    base = filler.moe_base(layer, name, t.path)
    bank = "down" if proj == "down" else "gate_up"
    rows = proj_rows(cfg, proj)
    scales = banks.extra[bank + "_scale"][base : base + cfg.num_experts, rows]
    try:
        nvs = gguf_experts.NvStack(f, t, scales, pool)
    except ValueError as e:
        raise CheckpointError(f"{t.path}: {e}") from None
    filler.expert_stack(layer, proj, "weight", nvs, name, t.path)
