"""Gemma-4's decoder layer: sliding / global attention of different geometry, a dense GeGLU MLP
beside a routed MoE block, sandwich norms, per-layer input embeddings and a layer scalar.

Attention (per layer ``i``): heads of ``cfg.layer_head_dim(i)`` with ``cfg.layer_num_kv_heads(i)``
KV heads; q and k get a per-head RMSNorm, v a weightless one; the softmax scale is 1 (the norms
set the magnitude). With ``attention_k_eq_v`` a global layer has no v_proj: V is K's projection
before k_norm and rope. The last ``num_kv_shared_layers`` layers have no K/V of their own: they
attend over the KV-pool layer of an earlier layer of their type.

MoE (every layer): the router reads the residual stream, RMS-normalised without a weight, times
``scale`` and hidden^-0.5; softmax over all experts, top k, renormalised, times the chosen
experts' ``per_expert_scale``. The experts see ``pre_feedforward_layernorm_2`` of the residual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..batch import ForwardBatch
from ..config import ModelConfig
from .attention import paged_attention
from .common import DenseMLP, Linear, RMSNorm, dtype_of, gelu_tanh, param, project
from .moe import route
from .rope import Rope


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight over the last dim, fp32."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps)


class Gemma4Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, kv_layer: int, shared: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        h, hid, eps = cfg.num_heads, cfg.hidden_size, cfg.rms_norm_eps
        d, kvh = cfg.layer_head_dim(layer), cfg.layer_num_kv_heads(layer)
        self.heads, self.kv_heads, self.head_dim, self.eps = h, kvh, d, eps
        self.kv_layer, self.shared = kv_layer, shared
        full = cfg.layer_types[layer] == "full_attention"
        self.window = None if full else cfg.sliding_window
        bias = cfg.attention_bias
        self.q_proj = Linear(hid, h * d, dtype, bias)
        self.q_norm = RMSNorm(d, eps, dtype)
        self.k_proj: Linear | None = None
        self.v_proj: Linear | None = None
        if not shared:  # a KV-shared layer's checkpoint has no k/v projections
            self.k_proj = Linear(hid, kvh * d, dtype, bias)
            self.k_norm = RMSNorm(d, eps, dtype)
            if not (cfg.attention_k_eq_v and full):
                self.v_proj = Linear(hid, kvh * d, dtype, bias)
        self.o_proj = Linear(h * d, hid, dtype, cfg.o_proj_bias)

    def _kv(
        self, x: torch.Tensor, rope: Rope, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K (normed, rotated) and V (weightless-normed): [n, kv_heads, d]."""
        assert self.k_proj is not None
        n = x.shape[0]
        shape = (n, self.kv_heads, self.head_dim)
        if self.v_proj is None:
            k = self.k_proj(x).view(shape)
            v = k
        else:
            k2, v2 = project(x, (self.k_proj, self.v_proj))
            k, v = k2.view(shape), v2.view(shape)
        return rope.apply(self.k_norm(k), cos, sin), _unit_rms(v, self.eps)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rope: Rope, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim))
        q = rope.apply(q, cos, sin).contiguous()
        kv = None if self.shared else self._kv(x, rope, cos, sin)
        out = paged_attention(batch, self.kv_layer, q, kv, 1.0, self.window)
        return self.o_proj(out.reshape(n, -1))


class Gemma4Router(nn.Module):
    """Checkpoint names: router.proj.weight [E, H], router.scale [H], router.per_expert_scale [E]."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = Linear(cfg.hidden_size, cfg.num_experts, dtype)
        self.scale = param(cfg.hidden_size, dtype=dtype)
        self.per_expert_scale = param(cfg.num_experts, dtype=dtype)
        self.top_k, self.eps = cfg.top_k, cfg.rms_norm_eps
        self.root = cfg.hidden_size**-0.5

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream [T, H] -> (expert ids [T, K], weights [T, K] fp32)."""
        x = _unit_rms(h, self.eps) * self.scale.float() * self.root
        ids, w = route(self.proj(x), self.top_k, softmax_first=True, renorm=True)
        return ids, w * self.per_expert_scale.float()[ids]


class Gemma4DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, i: int, moe_index: int, kv_layer: int, shared: bool
    ) -> None:
        super().__init__()
        dtype = dtype_of(cfg.torch_dtype)
        hid, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = cfg.layer_types[i]
        self.self_attn = Gemma4Attention(cfg, i, kv_layer, shared, dtype)
        inter = cfg.intermediate_size * (2 if cfg.double_wide_mlp and shared else 1)
        self.mlp = DenseMLP(hid, inter, dtype, act="gelu_tanh")
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
        ):
            setattr(self, name, RMSNorm(hid, eps, dtype))
        self.router = Gemma4Router(cfg, dtype)
        self.moe_index = moe_index
        self.layer_scalar = param(1, dtype=dtype)
        self.ple = cfg.hidden_size_per_layer_input
        if self.ple:
            self.per_layer_input_gate = Linear(hid, self.ple, dtype)
            self.per_layer_projection = Linear(self.ple, hid, dtype)
            self.post_per_layer_input_norm = RMSNorm(hid, eps, dtype)

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        norm: RMSNorm = getattr(self, name)
        return norm(x)

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        rope: Rope,
        cos: torch.Tensor,
        sin: torch.Tensor,
        per_layer: torch.Tensor | None,
    ) -> torch.Tensor:
        """h [N, H] fp32; per_layer [N, P] this layer's per-layer input (or None)."""
        a = self.self_attn(self._norm("input_layernorm", h), batch, rope, cos, sin)
        h = h + self._norm("post_attention_layernorm", a)
        dense = self._norm(
            "post_feedforward_layernorm_1", self.mlp(self._norm("pre_feedforward_layernorm", h))
        )
        ids, w = self.router(h)
        x = self._norm("pre_feedforward_layernorm_2", h)
        routed = self._norm(
            "post_feedforward_layernorm_2", batch.moe.forward(self.moe_index, x, ids, w)
        )
        h = h + self._norm("post_feedforward_layernorm", dense + routed)
        if per_layer is not None:
            g = gelu_tanh(self.per_layer_input_gate(h)) * per_layer
            h = h + self._norm("post_per_layer_input_norm", self.per_layer_projection(g))
        return h * self.layer_scalar.float()
