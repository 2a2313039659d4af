"""Qwen3-Next: the Gated-DeltaNet / gated-attention hybrid that Qwen3.5 grew from. Its linear
attention stores q, k, v, z in one projection (and b, a in another) grouped per key head; the
converters below regroup them into the separate projections our GatedDeltaNet layer uses."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .spec import CHATML_ANCHORS, FamilySpec


def _split_qkvz(cfg: ModelConfig, name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """[kh * (2 dk + 2 r dv), H] grouped per key head -> in_proj_qkv [2 kh dk + vh dv, H] and
    in_proj_z [vh dv, H] (r = value heads per key head)."""
    kh, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // kh
    g = w.view(kh, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
    prefix = name.removesuffix("in_proj_qkvz.weight")
    qkv = torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v)])
    return [
        (prefix + "in_proj_qkv.weight", qkv),
        (prefix + "in_proj_z.weight", z.reshape(-1, w.shape[-1])),
    ]


def _split_ba(cfg: ModelConfig, name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """[kh * 2r, H] grouped per key head -> in_proj_b [vh, H] and in_proj_a [vh, H]."""
    kh = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // kh
    g = w.view(kh, 2 * r, -1)
    prefix = name.removesuffix("in_proj_ba.weight")
    return [
        (prefix + "in_proj_b.weight", g[:, :r].reshape(-1, w.shape[-1])),
        (prefix + "in_proj_a.weight", g[:, r:].reshape(-1, w.shape[-1])),
    ]


SPEC = FamilySpec(
    renames=((r"\.mlp\.gate\.weight$", ".mlp.router.weight"),),
    ignore=(r"^mtp\.",),
    anchors=CHATML_ANCHORS,
    converters=(
        (r"linear_attn\.in_proj_qkvz\.weight$", _split_qkvz),
        (r"linear_attn\.in_proj_ba\.weight$", _split_ba),
    ),
)
