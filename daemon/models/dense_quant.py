"""Dense weights quantized after loading (``LLM(quantize=...)``, ``--quantize``): the `Linear`
layers of a float checkpoint turned into GGUF block rows (models/gguf_blocks.py) that the native
integer-dot kernels read (layers/qlinear_native.py), and the experts into one of the expert bank
formats (models/expert_quant.py).

A preset is a named mix per tensor class (the class of a Linear is read from its name):

  class      which layers                                   q4_k_m   q8_0     mxfp4
  attn_qkv   q/k/v projections (MLA's q_a/q_b/kv_a/kv_b)     q4_k     q8_0     q8_0
  attn_out   o_proj                                         q4_k     q8_0     q8_0
  mlp_in     gate_proj / up_proj (dense MLPs, shared experts) q4_k     q8_0     q8_0
  mlp_out    down_proj (dense MLPs, shared experts)         q8_0     q8_0     q8_0
  lm_head    the output projection                          q8_0     q8_0     q8_0
  experts    routed experts (expert bank format)            q4_k     q8_0     mxfp4

q4_k_m follows llama.cpp's Q4_K_M idea (4-bit K-quant blocks, the error-sensitive down
projections and output head kept wider: llama.cpp uses Q6_K there, which is not implemented here
yet, so they take q8_0). The routed experts take the GGUF block formats (experts/formats.py),
computed by the same integer-dot kernels (experts/block_executor.py); q4_k_m's expert down
projections stay q4_k (llama.cpp keeps some in Q6_K) until a wider K-quant lands. A layer (or an
expert projection: ``expert_format``) whose input size is not a multiple of the block (256 for
q4_k) takes q8_0, and of 32 stays float (experts: the preset fails, naming the sizes). Routers, the shared expert gate and linear-attention projections stay float (small, or
precision-sensitive).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from . import gguf_blocks
from .layers.common import Linear

log = logging.getLogger(__name__)

_CLASSES = (
    (
        "attn_qkv",
        re.compile(r"(^|\.)(q_proj|k_proj|v_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)$"),
    ),
    ("attn_out", re.compile(r"(^|\.)o_proj$")),
    ("mlp_in", re.compile(r"(^|\.)(gate_proj|up_proj)$")),
    ("mlp_out", re.compile(r"(^|\.)down_proj$")),
    ("lm_head", re.compile(r"(^|\.)lm_head$")),
)

PRESETS: dict[str, dict[str, str]] = {
    "q4_k_m": {
        "attn_qkv": "q4_k",
        "attn_out": "q4_k",
        "mlp_in": "q4_k",
        "mlp_out": "q8_0",
        "lm_head": "q8_0",
        "experts": "q4_k",
    },
    "q8_0": {
        "attn_qkv": "q8_0",
        "attn_out": "q8_0",
        "mlp_in": "q8_0",
        "mlp_out": "q8_0",
        "lm_head": "q8_0",
        "experts": "q8_0",
    },
    "mxfp4": {
        "attn_qkv": "q8_0",
        "attn_out": "q8_0",
        "mlp_in": "q8_0",
        "mlp_out": "q8_0",
        "lm_head": "q8_0",
        "experts": "mxfp4",
    },
}


def tensor_class(name: str) -> str | None:
    """The preset class of the Linear called ``name`` in the model, None when it stays float."""
    for cls, pat in _CLASSES:
        if pat.search(name):
            return cls
    return None


def _fit(fmt: str, cols: int) -> str | None:
    if gguf_blocks.supports(fmt, cols):
        return fmt
    return "q8_0" if gguf_blocks.supports("q8_0", cols) else None


def expert_format(preset: str, hidden: int, inter: int) -> str:
    """The expert format ``preset`` gives experts of these sizes: its block type per projection
    where the block divides the projection's input size (gate_up: H, down: I), q8_0 where only
    32 does (e.g. "q4_k/q8_0"); a format that is not a block type as it is."""
    from ..experts.formats import block_format

    fmt = PRESETS[preset]["experts"]
    if fmt not in gguf_blocks.QUANTIZE:
        return fmt
    gate_up, down = _fit(fmt, hidden), _fit(fmt, inter)
    if gate_up is None or down is None:
        raise ValueError(
            f"quantize {preset}: expert sizes H={hidden}, I={inter} are not multiples of 32"
        )
    return block_format(gate_up, down)


def quantize_dense(model: nn.Module, preset: str) -> dict[str, str]:
    """Quantizes every classified `Linear` of ``model`` in place (CPU weights only) per
    ``preset``; returns {layer name: format}. ValueError on an unknown preset."""
    if preset not in PRESETS:
        raise ValueError(f"quantize: {preset!r} is not one of {', '.join(sorted(PRESETS))}")
    mix = PRESETS[preset]
    done: dict[str, str] = {}
    before = after = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear) or mod.qweight is not None:
            continue
        cls = tensor_class(name)
        if cls is None or mod.weight.device.type != "cpu":
            continue
        fmt = _fit(mix[cls], mod.weight.shape[1])
        if fmt is None:
            continue
        before += mod.weight.numel() * mod.weight.element_size()
        mod.quantize_(fmt)
        assert mod.qweight is not None
        after += mod.qweight.nbytes
        done[name] = fmt
    log.info(
        "quantized %d dense layers (%s): %d -> %d MiB", len(done), preset, before >> 20, after >> 20
    )
    return done


@torch.no_grad()
def dequantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{"<layer>.weight": fp32 dequantized weight} of every quantized Linear: what an oracle model
    loads to compute with the same weights."""
    return {
        f"{name}.weight": mod.qweight.dequantize()
        for name, mod in model.named_modules()
        if isinstance(mod, Linear) and mod.qweight is not None
    }
