"""ModelConfig: the normalised model configuration that model code reads.

``config_hf.read_config`` reads a Hugging Face ``config.json`` into it through
``config_hf.from_dict``, the one place where every family's spelling of the same idea is
normalised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config.json we cannot serve; the message names the field."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rotary_dim: int = 0  # dims of each head that rotate (partial rotary); 0 = none
    # "default" | "yarn" | "proportional" (Gemma-4's global layers: the first
    # ``proportion * rotary_dim / 2`` frequencies of a full-head rope, the rest zero)
    kind: str = "default"
    proportion: float = 1.0
    # YaRN (GPT-OSS)
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # cos/sin scale (YaRN's mscale)
    interleaved: bool = False  # rotate pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of halves
    mscale_all_dim: float = 0.0  # DeepSeek YaRN: the softmax scale gets mscale(factor, this)^2


@dataclass(frozen=True)
class ModelConfig:
    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    # per-layer token mixer: "full_attention" | "sliding_attention" | "linear_attention"
    layer_types: tuple[str, ...]
    # per-layer: True when the layer's FFN is a routed MoE block (False = dense MLP)
    moe_layers: tuple[bool, ...]
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    intermediate_size: int = 0  # dense MLP layers
    shared_expert_intermediate_size: int = 0
    sliding_window: int | None = None
    attention_bias: bool = False
    attention_sinks: bool = False
    attention_output_gate: bool = False  # Qwen3.5 gated attention
    qk_norm: str = "none"  # "none" | "head" (per head) | "full" (over all heads, OLMoE)
    norm_offset: bool = False  # (1 + w) RMSNorm (Qwen3.5 / Qwen3-Next)
    clip_qkv: float | None = None
    o_proj_bias: bool = False  # the attention output projection's bias (GLM-4.5 has none)
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"  # "silu" | "gptoss" | "gelu_tanh" | "swiglu_clamp" (DeepSeek-V4)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    # Gated DeltaNet (linear attention)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # DeepSeek-V3: multi-head latent attention and the grouped sigmoid router
    q_lora_rank: int = 0  # 0 = q_proj; > 0 = q_a_proj -> RMSNorm -> q_b_proj
    kv_lora_rank: int = 0  # > 0 selects MLA
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    router_kind: str = (
        "softmax"  # "softmax" (softmax, top-k) | "topk_softmax" (GPT-OSS) | "sigmoid_group"
    )
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True  # the shared expert's sigmoid gate (Qwen); DeepSeek has none
    # router weight and logits in fp32 whatever the checkpoint dtype (DeepSeek-V3 and GLM compute
    # their grouped sigmoid router so; the input is not rounded to bf16 first)
    router_fp32: bool = False
    eos_token_ids: tuple[int, ...] = ()
    # multi-token-prediction layers stored after the last decoder layer (model.layers.<n + i>):
    # loaded past and skipped (speculative decoding does not use them yet)
    num_mtp_layers: int = 0
    torch_dtype: str = "float32"
    # routed experts as stored: "bf16" (float banks in torch_dtype), "mxfp4" (GPT-OSS's and
    # DeepSeek-V4's quantized checkpoints: e2m1 blocks of 32 with e8m0 scales, kept packed in
    # host RAM), "nvfp4" / "q4_0" (NVFP4 / INT4 releases, models/release_quant.py)
    expert_format: str = "bf16"
    # the weight-name prefix of the text model inside the checkpoint ("model" or
    # "model.language_model" for multimodal wrappers)
    weight_prefix: str = "model"
    # Gemma-4 (all empty / off for the other families):
    # per layer: head dim and KV head count (empty: head_dim / num_kv_heads everywhere)
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    rope_full: RopeConfig | None = None  # the full-attention layers' rope (None: ``rope``)
    attention_k_eq_v: bool = False  # full layers: V is K's projection (before k_norm / rope)
    num_kv_shared_layers: int = 0  # the last n layers reuse the KV of an earlier layer
    double_wide_mlp: bool = False  # KV-shared layers' dense MLP is twice intermediate_size
    hidden_size_per_layer_input: int = 0  # per-layer input embeddings (0: none)
    vocab_size_per_layer_input: int = 0
    final_logit_softcapping: float | None = None  # logits = c tanh(logits / c)
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA over the keys a Lightning Indexer
    # selects per query (layers/dsa.py); index_topk 0: dense MLA
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleaved: bool = False  # the indexer's rope: interleaved pairs, else halves
    # per layer: True where the layer has no indexer and reuses the previous one's selection
    index_shared: tuple[bool, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def moe_layer_index(self) -> tuple[int, ...]:
        """layer -> index among MoE layers (-1 for dense layers): the flat_id's layer part."""
        out, n = [], 0
        for is_moe in self.moe_layers:
            out.append(n if is_moe else -1)
            n += int(is_moe)
        return tuple(out)

    def layer_head_dim(self, i: int) -> int:
        return self.layer_head_dims[i] if self.layer_head_dims else self.head_dim

    def layer_num_kv_heads(self, i: int) -> int:
        return self.layer_kv_heads[i] if self.layer_kv_heads else self.num_kv_heads

    @property
    def kv_source_layers(self) -> tuple[int, ...]:
        """layer -> the layer whose K/V it attends over: itself, or for the last
        ``num_kv_shared_layers`` layers the last earlier layer of the same type that has its own
        K/V (Gemma-4)."""
        first = self.num_layers - self.num_kv_shared_layers
        out = []
        for i, kind in enumerate(self.layer_types):
            if i < first:
                out.append(i)
            else:
                out.append(max(j for j in range(first) if self.layer_types[j] == kind))
        return tuple(out)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def has_linear_attention(self) -> bool:
        return "linear_attention" in self.layer_types
