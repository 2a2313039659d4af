"""Gemma-4 MoE (``Gemma4ForCausalLM`` and the text model of ``Gemma4ForConditionalGeneration``).

Differs from the shared skeleton of `model.CausalLM` enough to have its own top level: the
embedding is scaled by sqrt(hidden) (in the weights' dtype), sliding and global layers have their
own rope (default / proportional) and KV geometry, optional per-layer input embeddings feed every
layer, and the logits may be softcapped. The KV pool gets one (kv_heads, head_dim) per KV-owning
layer (``kv_layer_shapes``); KV-shared layers own no pool layer.
"""

from __future__ import annotations

import torch
from torch import nn

from .batch import ForwardBatch
from .config import ModelConfig
from .layers.common import Embedding, Linear, RMSNorm, Weight, dtype_of
from .layers.gemma4 import Gemma4DecoderLayer
from .layers.rope import Rope
from .model import CausalLM


def _scaled(w: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows ``ids`` of embedding ``w`` times ``scale``, the product in w's dtype as transformers
    computes it (sqrt(hidden) rounds in bf16), then fp32."""
    return (w[ids] * torch.tensor(scale, dtype=w.dtype)).float()


class Gemma4CausalLM(CausalLM):
    """A CausalLM to the engine (same attributes and forward); its own modules."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)  # not CausalLM's layers
        self.cfg = cfg
        dtype = dtype_of(cfg.torch_dtype)
        self.dtype = dtype
        hid, n = cfg.hidden_size, cfg.num_layers
        self.embed_tokens = Embedding(cfg.vocab_size, hid, dtype)
        source = cfg.kv_source_layers
        kv_index: dict[int, int] = {}  # KV-owning layer -> its pool layer
        for i in range(n):
            if source[i] == i:
                kv_index[i] = len(kv_index)
        self.layers = nn.ModuleList(  # type: ignore[assignment]
            Gemma4DecoderLayer(cfg, i, cfg.moe_layer_index[i], kv_index[source[i]], source[i] != i)
            for i in range(n)
        )
        self.num_attention_layers = len(kv_index)
        self.num_linear_layers = 0
        # (kv_heads, head_dim) of each pool layer; kv_geometry: the largest (for sizing only)
        self.kv_layer_shapes = tuple(
            (cfg.layer_num_kv_heads(i), cfg.layer_head_dim(i)) for i in kv_index
        )
        self.kv_geometry = max(self.kv_layer_shapes, key=lambda s: s[0] * s[1])
        self.norm = RMSNorm(hid, cfg.rms_norm_eps, dtype)
        self.lm_head = Linear(hid, cfg.vocab_size, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.ple = cfg.hidden_size_per_layer_input
        if self.ple:
            self.embed_tokens_per_layer = Weight(
                cfg.vocab_size_per_layer_input, n * self.ple, dtype=dtype
            )
            self.per_layer_model_projection = Linear(hid, n * self.ple, dtype)
            self.per_layer_projection_norm = RMSNorm(self.ple, cfg.rms_norm_eps, dtype)
        self.rope = Rope(cfg.rope)
        self.rope_full = Rope(cfg.rope_full or cfg.rope)

    def _per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[N, layers, P]: (norm(projection of the scaled embedding) + per-layer embedding) / sqrt 2."""
        n, p = ids.shape[0], self.ple
        tok = _scaled(self.embed_tokens_per_layer.weight, ids, p**0.5).view(n, -1, p)
        proj = self.per_layer_model_projection(h) * self.cfg.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.view(n, -1, p))
        return (proj + tok) * 2.0**-0.5

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> logits [len(batch.logits_rows), vocab] fp32."""
        ids = batch.token_ids
        h = _scaled(self.embed_tokens.weight, ids, self.cfg.hidden_size**0.5)
        per_layer = self._per_layer_inputs(ids, h) if self.ple else None
        ropes = {
            "sliding_attention": (
                self.rope,
                *self.rope.cos_sin(batch.positions, batch.max_position),
            ),
            "full_attention": (
                self.rope_full,
                *self.rope_full.cos_sin(batch.positions, batch.max_position),
            ),
        }
        for i, layer in enumerate(self.layers):
            rope, cos, sin = ropes[self.cfg.layer_types[i]]
            pli = per_layer[:, i] if per_layer is not None else None
            h = layer(h, batch, rope, cos, sin, pli)
        logits = self.lm_head(self.norm(h[batch.logits_rows]))
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
