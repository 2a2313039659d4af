"""Multi-head latent attention (DeepSeek-V2/V3).

Keys and values are stored compressed: per token one latent [kv_lora_rank] (after its RMSNorm)
plus one shared rotated key part [qk_rope_head_dim], kept together in the K half of the KV pool
(one "head" of kv_lora_rank + qk_rope_head_dim). At attention time the latents of the context
are expanded by kv_b_proj into per-head k_nope [qk_nope_head_dim] and v [v_head_dim].

A GGUF file holds kv_b_proj split per head (``attn_k_b`` [kv_lora_rank rows of qk_nope_head_dim
inputs], ``attn_v_b`` [v_head_dim rows of kv_lora_rank inputs]); in a block format the loader
keeps both in their blocks (``keep_joined_blocks``) and attention runs absorbed, as llama.cpp
computes it: the query's non-rotated part is folded into the latent space per head, q_lat[h] =
attn_k_b[h] q_nope[h], scores are taken against the latents themselves ([q_lat | q_rope] .
[latent | rotated key]), the softmax-weighted latent comes out per head, and out[h] =
attn_v_b[h] latent_out[h]; both per-head products run in the integer-dot kernels (int8 inputs per
32), so no float copy of kv_b is made and the sums are llama.cpp's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...native.qlinear_native import QuantWeight
from ..batch import ForwardBatch
from ..config import ModelConfig
from .common import Linear, RMSNorm, block_linear
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


# (query token x head) x context elements of one absorbed attention block: bounds its mask and
# scores (a 512-token chunk of 128 heads at 16k of context would otherwise be 1G of each)
_ABSORB_BLOCK = 1 << 24


def _per_head(qw: QuantWeight, heads: int) -> list[QuantWeight]:
    """The head-major rows of ``qw`` split into one weight per head."""
    raw, n = qw.gguf_raw(), qw.rows // heads
    return [QuantWeight.from_raw(raw[h * n : (h + 1) * n], qw.fmt, qw.cols) for h in range(heads)]


class MLAttention(nn.Module):
    # kv_b_proj's GGUF parts may be kept in their blocks (gguf_loader, ``keep_joined_blocks``)
    joined_blocks = ("kv_b_proj",)

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
        self.kv_b_proj: Linear | None = Linear(self.kvr, h * (self.dn + self.dv), dtype)
        # per head: attn_k_b's rows [kvr, dn] and attn_v_b's [dv, kvr] in GGUF blocks, in
        # place of kv_b_proj (module docstring)
        self.kv_b_blocks: tuple[list[QuantWeight], list[QuantWeight]] | None = None
        self.o_proj = Linear(h * self.dv, hid, dtype, cfg.o_proj_bias)
        self.scale = mla_scale(cfg)

    def keep_joined_blocks(self, name: str, parts: list[QuantWeight]) -> None:
        """kv_b_proj's GGUF parts in their blocks: attn_k_b [heads * kvr, dn] and attn_v_b
        [heads * dv, kvr], head-major rows."""
        assert name == "kv_b_proj", name
        k_b, v_b = parts
        h = self.heads
        if (k_b.rows, k_b.cols) != (h * self.kvr, self.dn) or (v_b.rows, v_b.cols) != (
            h * self.dv,
            self.kvr,
        ):
            raise ValueError(
                f"attn_k_b {k_b.rows}x{k_b.cols} / attn_v_b {v_b.rows}x{v_b.cols} do not fit "
                f"{h} heads of kv_lora_rank {self.kvr}, nope {self.dn}, v {self.dv}"
            )
        self.kv_b_blocks = (_per_head(k_b, h), _per_head(v_b, h))
        self.kv_b_proj = None

    def widen_blocks(self, device: torch.device | None, dtype: torch.dtype | None) -> None:
        """kv_b's blocks back to a float kv_b_proj (the expanded path), on ``device`` in
        ``dtype`` (None: the model's, o_proj's): ``common.widen_kept_blocks``."""
        if self.kv_b_blocks is None:
            return
        k_b, v_b = self.kv_b_blocks
        k = torch.stack([w.dequantize(device) for w in k_b]).transpose(1, 2)  # [h, dn, kvr]
        v = torch.stack([w.dequantize(device) for w in v_b])  # [h, dv, kvr]
        w = torch.cat([k, v], 1).reshape(-1, self.kvr).to(dtype or self.o_proj.weight.dtype)
        lin = Linear(self.kvr, w.shape[0], w.dtype)
        lin.weight = nn.Parameter(w, requires_grad=False)
        self.kv_b_proj, self.kv_b_blocks = lin, None

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [n, heads, dn] -> q_lat [n, heads, kvr] through attn_k_b's blocks."""
        assert self.kv_b_blocks is not None
        k_b = self.kv_b_blocks[0]
        return torch.stack([block_linear(q_nope[:, i], k_b[i]) for i in range(self.heads)], 1)

    def values_from_latent(self, lat: torch.Tensor) -> torch.Tensor:
        """lat [n, heads, kvr] (softmax-weighted latents) -> [n, heads, dv] through
        attn_v_b's blocks."""
        assert self.kv_b_blocks is not None
        v_b = self.kv_b_blocks[1]
        return torch.stack([block_linear(lat[:, i], v_b[i]) for i in range(self.heads)], 1)

    def absorbed_attention(
        self, q: torch.Tensor, kc: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """q [n, heads, dn + dr] over pool rows kc [c, >= kvr + dr] fp32 where ``allowed`` [n,
        c], in absorbed form with kv_b in its blocks (module docstring) -> [n, heads, dv]."""
        n, h, w = q.shape[0], self.heads, self.kvr + self.dr
        qa = torch.cat([self.absorb_query(q[..., : self.dn]), q[..., self.dn :]], dim=-1)
        # one key row per token for every head: the (token, head) pairs are the queries, in
        # blocks of queries whose (token x head) x context mask stays within _ABSORB_BLOCK
        keys = kc[None, :, :w]
        lat = torch.empty(n, h, self.kvr, dtype=keys.dtype, device=keys.device)
        step = max(1, _ABSORB_BLOCK // max(1, h * kc.shape[0]))
        for b0 in range(0, n, step):
            b1 = min(n, b0 + step)
            lat[b0:b1] = F.scaled_dot_product_attention(
                qa[b0:b1].reshape(1, (b1 - b0) * h, w),
                keys,
                keys[..., : self.kvr],
                attn_mask=allowed[b0:b1].repeat_interleave(h, 0),
                scale=self.scale,
            ).view(b1 - b0, h, self.kvr)
        return self.values_from_latent(lat)

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
        assert self.kv_b_proj is not None, "kv_b in blocks: absorbed_attention"
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
            if self.kv_b_blocks is not None:
                allowed = causal_mask(ch.length, end, ch.context_len, x.device)
                out[rows] = self.absorbed_attention(q[rows], kc[:, 0].float(), allowed)
                continue
            k, v = self.expand(kc[:, 0].float())
            out[rows] = _causal(q[rows], k, v, ch.context_len, self.scale)
        return self.o_proj(out.reshape(n, -1))
