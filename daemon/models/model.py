"""The decoder-only MoE language model assembled from shared layers.

Every family we serve has the same skeleton (pre-norm mixer, pre-norm FFN, residuals); the
differences are ModelConfig fields (token mixer per layer, qk-norm kind, sinks, gates, biases,
router kind, shared expert). Routed experts are not parameters of this module: they live in
ExpertBanks behind the MoE backend, addressed by flat id.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from .batch import ForwardBatch
from .config import ModelConfig
from .layers import cpu_decode
from .layers.attention import Attention, decode_workspace_bytes
from .layers.common import DenseMLP, Embedding, Linear, RMSNorm, dtype_of
from .layers.deltanet import GatedDeltaNet
from .layers.dsa import SparseMLAttention, pool_row_widths
from .layers.mla import MLAttention
from .layers.moe import SparseMoE
from .layers.rope import Rope
from .registry import family_spec

PAGE_SIZE = 16  # tokens a KV page holds unless the engine says otherwise (EngineConfig)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, mixer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, off)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, off)
        self.kind = cfg.layer_types[i]
        self.self_attn: Attention | MLAttention | None = None
        self.linear_attn: GatedDeltaNet | None = None
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, mixer_index, dtype)
        elif cfg.is_mla and cfg.index_topk:  # DeepSeek Sparse Attention
            self.self_attn = SparseMLAttention(cfg, i, mixer_index, dtype)
        elif cfg.is_mla:
            self.self_attn = MLAttention(cfg, mixer_index, dtype)
        else:
            self.self_attn = Attention(cfg, i, mixer_index, dtype)
        moe_index = cfg.moe_layer_index[i]
        self.mlp: nn.Module = (
            SparseMoE(cfg, moe_index, dtype)
            if moe_index >= 0
            else DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        )
        self._decode_plan: cpu_decode.LayerPlan | None = None
        self._plan_made = False

    def decode_plan(self) -> cpu_decode.LayerPlan | None:
        """The layer's native CPU decode plan (layers/cpu_decode.py), made at its first decode
        step; None when the layer does not qualify."""
        if not self._plan_made:
            self._decode_plan, self._plan_made = cpu_decode.plan_for(self), True
        return self._decode_plan

    def forward(
        self, h: torch.Tensor, batch: ForwardBatch, rope: Rope, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.linear_attn is not None:
            h = h + self.linear_attn(x, batch)
        else:
            assert self.self_attn is not None
            h = h + self.self_attn(x, batch, rope, cos, sin)
        x = self.post_attention_layernorm(h)
        if isinstance(self.mlp, SparseMoE):
            return h + self.mlp(x, batch)
        return h + self.mlp(x)


class CausalLM(nn.Module):
    # a per-sequence state of the model's own beside the KV pool (``SeqState.v4``: DeepSeek-V4),
    # sized by `state_bytes_per_token` and `state_bytes_per_seq`
    own_state = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dtype = dtype_of(cfg.torch_dtype)
        self.dtype = dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        counters = {"linear": 0, "attn": 0}
        layers: list[DecoderLayer] = []
        for i, kind in enumerate(cfg.layer_types):
            key = "linear" if kind == "linear_attention" else "attn"
            layers.append(DecoderLayer(cfg, i, counters[key], dtype))
            counters[key] += 1
        self.layers = nn.ModuleList(layers)
        self._decoder_layers: list[DecoderLayer] = layers  # the same, typed (the decode plans)
        self.num_linear_layers = counters["linear"]
        self.num_attention_layers = counters["attn"]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype)
        # KV pool geometry per token and attention layer: (heads, head_dim) of K (= of V)
        self.kv_geometry = (
            (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            if cfg.is_mla
            else (cfg.num_kv_heads, cfg.head_dim)
        )
        # per pool layer (kv_heads, head_dim) when layers differ (Gemma-4); None: kv_geometry
        self.kv_layer_shapes: tuple[tuple[int, int], ...] | None = None
        if cfg.is_mla and cfg.index_topk:  # DSA: index keys beside the latents (layers/dsa.py)
            self.kv_layer_shapes = tuple((1, w) for w in pool_row_widths(cfg))
            self.kv_geometry = max(self.kv_layer_shapes)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = Rope(cfg.rope)
        self._decode_head: cpu_decode.HeadPlan | None = None

    def pool_regions(self, page_size: int) -> list[tuple[int, int]]:
        """(rows, width) of each page region the KV pool holds for the model (kv/pool.py): state
        kept by page beside K and V (DeepSeek-V4's compressed entries); none by default."""
        return []

    def state_bytes_per_token(self, page_size: int = PAGE_SIZE) -> int:
        """Bytes per token of the model's state beyond K and V that grows with the sequence
        (its page regions, in pages of ``page_size`` tokens; 0: none; rounded up)."""
        return 0

    def state_bytes_per_seq(self) -> int:
        """Bytes the model's own state holds per sequence whatever its length, at most (0: none).
        A sequence of L tokens holds at most this + L * `state_bytes_per_token`."""
        return 0

    def decode_head(self) -> cpu_decode.HeadPlan:
        """The embedding and last norm as the native decode path calls them, made at the first
        decode step and again when either module's weight was replaced."""
        head = self._decode_head
        if head is None or not head.matches(self.embed_tokens.weight, self.norm, self.lm_head):
            emb = self.embed_tokens
            head = self._decode_head = cpu_decode.HeadPlan(
                emb.weight, self.norm, self.lm_head, emb if emb.blocks is not None else None
            )
        return head

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> logits [len(batch.logits_rows), vocab] fp32."""
        embed = self.embed_tokens.weight
        cos, sin = self.rope.cos_sin(batch.positions, batch.max_position)
        step = cpu_decode.start(batch, embed, cos, sin, self.rope.cfg)
        head = self.decode_head() if step is not None else None
        if head is not None and step is not None:
            # every layer planned: one native call from the token ids to the logits
            every = [p for p in (la.decode_plan() for la in self._decoder_layers) if p is not None]
            if len(every) == len(self._decoder_layers):
                logits = head.whole(step, every, batch.token_ids, batch.logits_rows.shape[0])
                if logits is not None:
                    return logits
        h = head.embed(step, batch.token_ids) if head is not None and step is not None else None
        if h is None:
            h = self.embed_tokens.rows(batch.token_ids)
        plans: list[cpu_decode.LayerPlan] = []  # a run of layers the native call decodes
        for layer in self._decoder_layers:
            plan = layer.decode_plan() if step is not None else None
            if plan is not None:
                plans.append(plan)
                continue
            if plans and step is not None:
                step.run(plans, h)  # in place: h is this forward's own tensor
                plans = []
            h = layer(h, batch, self.rope, cos, sin)
        if plans and step is not None:
            step.run(plans, h)
        x = None
        if head is not None and step is not None:
            x = head.final_norm(step, h, batch.logits_rows.shape[0])
        if x is None:
            x = self.norm(h[batch.logits_rows])
        return self.lm_head(x)


def build_model(cfg: ModelConfig) -> CausalLM:
    """The model of ``cfg``'s family (parameters uninitialised): ``CausalLM``, or the family's
    own top level (``FamilySpec.model``, a CausalLM subclass in a module that imports this one,
    hence imported on use)."""
    spec = family_spec(cfg.family)
    if not spec.model:
        return CausalLM(cfg)
    module, _, name = spec.model.partition(":")
    cls = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    assert issubclass(cls, CausalLM), spec.model
    return cls(cfg)


def model_tables(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's integer buffers: tables a checkpoint holds (DeepSeek-V4's hash routing
    ``tid2eid``), which the loaders fill as they fill parameters."""
    return {n: b for n, b in model.named_buffers() if not b.is_floating_point()}


def kv_bytes_per_token(model: CausalLM, page_size: int = PAGE_SIZE) -> int:
    """Bytes one cached token takes: K and V in the KV pool over all attention layers, plus
    the pool's page regions per token in pages of ``page_size`` (DeepSeek-V4's compressed
    entries; its fixed part per sequence: `CausalLM.state_bytes_per_seq`)."""
    itemsize = model.dtype.itemsize
    if model.kv_layer_shapes:
        pool = 2 * sum(h * d for h, d in model.kv_layer_shapes) * itemsize
    else:
        heads, head_dim = model.kv_geometry
        pool = 2 * model.num_attention_layers * heads * head_dim * itemsize
    return pool + model.state_bytes_per_token(page_size)


def decode_attention_bytes(model: CausalLM, rows: int, keys: int, page_size: int) -> int:
    """Device bytes decode attention's work buffers take at peak for ``rows`` decode rows over
    page tables of ``keys`` keys (``attention.decode_workspace_bytes`` at the model's widest
    pool layer); 0 without attention layers."""
    if model.num_attention_layers == 0:
        return 0
    kv_heads, head_dim = max(
        model.kv_layer_shapes or (model.kv_geometry,), key=lambda s: s[0] * s[1]
    )
    return decode_workspace_bytes(
        rows, keys, model.cfg.num_heads, kv_heads, head_dim, page_size, model.dtype.itemsize
    )
