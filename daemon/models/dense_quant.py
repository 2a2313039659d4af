"""Dense weights quantized after loading (``LLM(quantize=...)``, ``--quantize``): the `Linear`
layers of a float checkpoint turned into GGUF block rows (formats/gguf_blocks.py) that the native
integer-dot kernels read (native/qlinear_native.py), and the experts into one of the expert bank
formats (models/expert_quant.py).

A preset is a named mix per tensor class (the class of a Linear is read from its name):

  class      which layers                                    q4_k_m        q8_0       mxfp4
  attn_qkv   q/k projections (MLA's q_a/q_b/kv_a)             q4_k          q8_0       mxfp4
  attn_v     v_proj (MLA's kv_b_proj)                         q4_k / q6_k*  q8_0       mxfp4
  attn_out   o_proj                                          q4_k          q8_0       mxfp4
  mlp_in     gate_proj / up_proj (dense MLPs, shared experts) q4_k          q8_0       mxfp4
  mlp_out    down_proj (dense MLPs, shared experts)          q4_k / q6_k*  q8_0       mxfp4
  lm_head    the output projection                           q6_k          q8_0       q8_0
  experts    routed experts (expert bank format)             q4_k          q8_0       mxfp4

q4_k_m is llama.cpp's Q4_K_M mix (src/llama-quant.cpp) for the tensors we quantize: Q4_K by
default, Q6_K for the output head, and (*) Q6_K for attn_v and ffn_down in the layers its
``use_more_bits`` picks: the first and last eighth of the layers and every third one between
(i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2; for attn_v, i and n count the layers that have one,
for ffn_down all layers). Not followed: its extra rules for 8-expert models (attn_v and attn_k
Q8_0, attn_output Q5_K; Mixtral-style), and Q6_K for some routed experts' down projections: ours
stay q4_k. Routed experts take the GGUF block formats (experts/formats.py), computed by the same
integer-dot kernels (experts/block_executor.py); an expert projection whose input size the block
does not divide falls back as below (``expert_format``), and one that fits no block of 32 fails
the preset, naming the sizes.

mxfp4 puts every dense projection on the native MXFP4 kernel (4-bit e2m1 with a power-of-two
scale per 32 inputs) and keeps the output head q8_0, as llama.cpp's MXFP4_MOE does; that mix
keeps the other dense tensors Q8_0 too, so ours is smaller and less exact than a gpt-oss file's.

A layer whose input size does not fit the block falls back as llama.cpp does: q4_k to q5_0 (32),
q6_k and q5_k to q8_0 (llama.cpp takes q5_1 for q5_k, which is not implemented); one that fits no
block of 32 stays float. Routers, the shared expert gate and linear-attention projections stay
float (small, or precision-sensitive).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from ..experts.formats import block_format
from ..formats import gguf_blocks
from .layers.common import Linear

log = logging.getLogger(__name__)

_CLASSES = (
    ("attn_qkv", re.compile(r"(^|\.)(q_proj|k_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa)$")),
    ("attn_v", re.compile(r"(^|\.)(v_proj|kv_b_proj)$")),
    ("attn_out", re.compile(r"(^|\.)o_proj$")),
    ("mlp_in", re.compile(r"(^|\.)(gate_proj|up_proj)$")),
    ("mlp_out", re.compile(r"(^|\.)down_proj$")),
    ("lm_head", re.compile(r"(^|\.)lm_head$")),
)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

PRESETS: dict[str, dict[str, str]] = {
    "q4_k_m": {
        "attn_qkv": "q4_k",
        "attn_v": "q4_k",
        "attn_out": "q4_k",
        "mlp_in": "q4_k",
        "mlp_out": "q4_k",
        "lm_head": "q6_k",
        "experts": "q4_k",
    },
    "q8_0": {
        "attn_qkv": "q8_0",
        "attn_v": "q8_0",
        "attn_out": "q8_0",
        "mlp_in": "q8_0",
        "mlp_out": "q8_0",
        "lm_head": "q8_0",
        "experts": "q8_0",
    },
    "mxfp4": {
        "attn_qkv": "mxfp4",
        "attn_v": "mxfp4",
        "attn_out": "mxfp4",
        "mlp_in": "mxfp4",
        "mlp_out": "mxfp4",
        "lm_head": "q8_0",
        "experts": "mxfp4",
    },
}
# Per preset: {class: format} in the layers llama.cpp's use_more_bits picks.
MORE_BITS: dict[str, dict[str, str]] = {"q4_k_m": {"attn_v": "q6_k", "mlp_out": "q6_k"}}
# llama.cpp's fallback when the input size is not a multiple of the block (q5_k: see above).
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q8_0", "q6_k": "q8_0"}


def tensor_class(name: str) -> str | None:
    """The preset class of the Linear called ``name`` in the model, None when it stays float."""
    for cls, pat in _CLASSES:
        if pat.search(name):
            return cls
    return None


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that keep more bits in its K-quant mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _fit(fmt: str, cols: int) -> str | None:
    if gguf_blocks.supports(fmt, cols):
        return fmt
    back = _FALLBACK.get(fmt)
    return back if back is not None and gguf_blocks.supports(back, cols) else None


def choose_formats(layers: Iterable[tuple[str, int]], preset: str) -> dict[str, str]:
    """{name: format} for the (Linear name, input size) pairs of one model under ``preset``;
    names of no class, or fitting no block, are left out. ValueError on an unknown preset."""
    if preset not in PRESETS:
        raise ValueError(f"quantize: {preset!r} is not one of {', '.join(sorted(PRESETS))}")
    mix, more = PRESETS[preset], MORE_BITS.get(preset, {})
    classed = [(name, cols, tensor_class(name)) for name, cols in layers]
    all_layers = {i for name, _, _ in classed if (i := _layer(name)) is not None}
    n_layer = max(all_layers) + 1 if all_layers else 0
    v_layers = sorted({i for n, _, c in classed if c == "attn_v" and (i := _layer(n)) is not None})
    out: dict[str, str] = {}
    for name, cols, cls in classed:
        if cls is None:
            continue
        fmt = mix[cls]
        i = _layer(name)
        if cls in more and i is not None:
            rank, n = (v_layers.index(i), len(v_layers)) if cls == "attn_v" else (i, n_layer)
            if use_more_bits(rank, n):
                fmt = more[cls]
        fitted = _fit(fmt, cols)
        if fitted is not None:
            out[name] = fitted
    return out


def expert_format(preset: str, hidden: int, inter: int) -> str:
    """The expert format ``preset`` gives experts of these sizes: its block type per projection
    where the block divides the projection's input size (gate_up: H, down: I), q8_0 where only
    32 does (e.g. "q4_k/q8_0"); a format that is not a block type as it is."""

    fmt = PRESETS[preset]["experts"]
    if fmt not in gguf_blocks.BLOCK_BYTES:
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
    mods = {
        name: mod
        for name, mod in model.named_modules()
        if isinstance(mod, Linear) and mod.qweight is None and mod.weight.device.type == "cpu"
    }
    done = choose_formats(((n, m.weight.shape[1]) for n, m in mods.items()), preset)
    before = after = 0
    for name, fmt in done.items():
        mod = mods[name]
        before += mod.weight.numel() * mod.weight.element_size()
        mod.quantize_(fmt)
        assert mod.qweight is not None
        after += mod.qweight.nbytes
    counts = {f: list(done.values()).count(f) for f in sorted(set(done.values()))}
    log.info(
        "quantized %d dense layers (%s: %s): %d -> %d MiB",
        len(done),
        preset,
        counts,
        before >> 20,
        after >> 20,
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
