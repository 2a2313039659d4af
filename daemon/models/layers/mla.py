"""Multi-head latent attention (DeepSeek-V2/V3).

Keys and values are stored compressed: per token one latent [kv_lora_rank] (after its RMSNorm)
plus one shared rotated key part [qk_rope_head_dim], kept together in the K half of the KV pool
(one "head" of kv_lora_rank + qk_rope_head_dim). At attention time the latents of the context
are expanded by kv_b_proj into per-head k_nope [qk_nope_head_dim] and v [v_head_dim].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..batch import ForwardBatch
from ..config import ModelConfig
from .common import Linear, RMSNorm
from .rope import Rope


def causal_mask(n: int, c: int, q_start: int, device: torch.device) -> torch.Tensor:
    """[n, c] bool: query i (at position q_start + i) may see key j (at position j)."""
    kpos = torch.arange(c, device=device).unsqueeze(0)
    return kpos <= torch.arange(q_start, q_start + n, device=device).unsqueeze(1)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, h, dqk], k [c, h, dqk], v [c, h, dv], allowed [n, c] bool -> [n, h, dv]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
    )
    return out.transpose(0, 1)


def _causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float
) -> torch.Tensor:
    """q [n, h, dqk], k [c, h, dqk], v [c, h, dv] -> [n, h, dv]; query i sits at q_start + i."""
    allowed = causal_mask(q.shape[0], k.shape[0], q_start, q.device)
    return masked_attention(q, k, v, allowed, scale)


def mla_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    r = cfg.rope
    if r.kind != "default" and r.mscale_all_dim and r.factor > 1:
        m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, hid = cfg.num_heads, cfg.hidden_size
        self.heads, self.kv_layer = h, kv_layer
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kvr = cfg.kv_lora_rank
        # the latent norms use RMSNorm's default eps in every MLA family, not rms_norm_eps
        dqk, bias, eps = self.dn + self.dr, cfg.attention_bias, 1e-6
        self.q_proj: Linear | None = None
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(hid, cfg.q_lora_rank, dtype, bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps, dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * dqk, dtype)
        else:
            self.q_proj = Linear(hid, h * dqk, dtype)
        self.kv_a_proj_with_mqa = Linear(hid, self.kvr + self.dr, dtype, bias)
        self.kv_a_layernorm = RMSNorm(self.kvr, eps, dtype)
        self.kv_b_proj = Linear(self.kvr, h * (self.dn + self.dv), dtype)
        self.o_proj = Linear(h * self.dv, hid, dtype, cfg.o_proj_bias)
        self.scale = mla_scale(cfg)

    def _q_res(self, x: torch.Tensor) -> torch.Tensor | None:
        """The compressed query (after its norm); None without query compression."""
        if self.q_proj is not None:
            return None
        return self.q_a_layernorm(self.q_a_proj(x))

    def _q(self, x: torch.Tensor, q_res: torch.Tensor | None) -> torch.Tensor:
        return self.q_proj(x) if self.q_proj is not None else self.q_b_proj(q_res)

    def project(
        self, x: torch.Tensor, rope: Rope, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> the queries [n, heads, dn + dr] (rope applied), the pool rows [n, 1, kvr + dr]
        (latent, rotated key part) and the compressed query (None without one)."""
        n = x.shape[0]
        q_res = self._q_res(x)
        q = self._q(x, q_res).view(n, self.heads, self.dn + self.dr)
        q = torch.cat([q[..., : self.dn], rope.apply(q[..., self.dn :], cos, sin)], dim=-1)
        ckv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(ckv[:, : self.kvr])
        k_rot = rope.apply(ckv[:, self.kvr :].view(n, 1, self.dr), cos, sin)
        return q, torch.cat([latent.unsqueeze(1), k_rot], dim=-1), q_res

    def expand(self, kc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool rows kc [c, >= kvr + dr] fp32 -> keys [c, heads, dn + dr], values [c, heads,
        dv]."""
        c = kc.shape[0]
        kv = self.kv_b_proj(kc[:, : self.kvr]).view(c, self.heads, self.dn + self.dv)
        rot = kc[:, None, self.kvr : self.kvr + self.dr].expand(c, self.heads, self.dr)
        return torch.cat([kv[..., : self.dn], rot], -1), kv[..., self.dn :]

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rope: Rope, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        q, packed, _ = self.project(x, rope, cos, sin)
        out = torch.empty(n, self.heads, self.dv, device=x.device)
        for ch in batch.chunks:
            rows = slice(ch.start, ch.start + ch.length)
            end = ch.context_len + ch.length
            batch.kv.write(self.kv_layer, ch.state.pages, ch.context_len, packed[rows], None)
            table = ch.state.pages if ch.table is None else ch.table
            kc, _ = batch.kv.read(self.kv_layer, table, end)
            k, v = self.expand(kc[:, 0].float())
            out[rows] = _causal(q[rows], k, v, ch.context_len, self.scale)
        return self.o_proj(out.reshape(n, -1))
