"""Gemma-4 with the MoE block (26B-A4B): see `gemma4_model` and `layers.gemma4`. The routed
experts are stored beside the layer's dense MLP (``layers.<i>.experts.gate_up_proj`` [E, 2I, H],
gate rows then up rows); the router is the layer's ``router`` module. The multimodal wrapper is
served text-only: its vision and audio towers and their embedders are not loaded.

Its config differs most from the others': per-layer geometry (global layers have another head
dim and KV head count), two ropes, KV sharing, per-layer input embeddings, softcapping
(``_text`` and ``_fields``). In GGUF, llama.cpp keeps its norms as they are (no +1), its router's
scales as ``ffn_gate_inp.scale`` / ``ffn_down_exps.scale`` and its global layers' proportional
rope as ``rope_freqs`` factors (read into the config)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import ConfigError, ModelConfig, RopeConfig
from ..config_read import get
from ..gguf_read import GgufMeta
from .spec import FamilySpec, GgufRules, HfRules


def _text(text: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma-4's spellings of the shared fields, and what we do not serve."""
    if not text.get("enable_moe_block"):
        raise ConfigError(
            f"{source}: field 'enable_moe_block' is false: only the Gemma-4 MoE models are served"
        )
    if text.get("use_bidirectional_attention") == "all":
        raise ConfigError(f"{source}: field 'use_bidirectional_attention' = 'all' is not supported")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: field 'hidden_activation' = {act!r} is not supported")
    out = {"head_dim": 256, "sliding_window": 512, "tie_word_embeddings": True, **text}
    out["num_experts_per_tok"] = text.get("top_k_experts")
    out["norm_topk_prob"] = True  # the router always renormalises its top-k
    return out


def _layer_types(text: dict[str, Any], n: int) -> list[str]:
    """transformers' default: five sliding layers, then a full one."""
    return ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]


def _fields(text: dict[str, Any], cfg: ModelConfig, source: str) -> dict[str, Any]:
    """Per-layer geometry (global layers: another head dim and KV head count), the two ropes,
    KV sharing, per-layer input embeddings and softcapping, as transformers reads them."""
    n = cfg.num_layers
    per_layer = text.get("per_layer_config")
    if isinstance(per_layer, dict):  # written by transformers: layer index -> overrides
        over = {int(k): v for k, v in per_layer.items() if isinstance(v, dict)}
    else:  # Google's configs: global_head_dim / num_global_key_value_heads for full layers
        o: dict[str, Any] = {"head_dim": get(text, "global_head_dim", int, source, 512)}
        if text.get("attention_k_eq_v") and text.get("num_global_key_value_heads"):
            o["num_key_value_heads"] = get(text, "num_global_key_value_heads", int, source)
        over = {i: o for i, t in enumerate(cfg.layer_types) if t == "full_attention"}
    dims = tuple(int(over.get(i, {}).get("head_dim", cfg.head_dim)) for i in range(n))
    kvh = tuple(int(over.get(i, {}).get("num_key_value_heads", cfg.num_kv_heads)) for i in range(n))
    params = text.get("rope_parameters") or {}
    full_dim = next((dims[i] for i, t in enumerate(cfg.layer_types) if t == "full_attention"), 0)
    return dict(
        layer_head_dims=dims,
        layer_kv_heads=kvh,
        rope=_rope(params.get("sliding_attention"), cfg.head_dim, 10_000.0, source),
        rope_full=_rope(params.get("full_attention"), full_dim, 1_000_000.0, source),
        attention_k_eq_v=bool(text.get("attention_k_eq_v", False)),
        num_kv_shared_layers=get(text, "num_kv_shared_layers", int, source, 0),
        double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
        hidden_size_per_layer_input=get(text, "hidden_size_per_layer_input", int, source, 0),
        vocab_size_per_layer_input=get(
            text, "vocab_size_per_layer_input", int, source, cfg.vocab_size
        ),
        final_logit_softcapping=get(text, "final_logit_softcapping", float, source, None),
        activation="gelu_tanh",
        attention_bias=bool(text.get("attention_bias", False)),
        o_proj_bias=bool(text.get("attention_bias", False)),
    )


def _rope(params: Any, head_dim: int, theta: float, source: str) -> RopeConfig:
    """One layer type's rope: "default" over the whole head, or "proportional"."""
    p = params if isinstance(params, dict) else {}
    kind = p.get("rope_type", "default") or "default"
    if kind not in ("default", "proportional"):
        raise ConfigError(f"{source}: Gemma-4 rope_type {kind!r} is not supported")
    if float(p.get("factor", 1.0) or 1.0) != 1.0:
        raise ConfigError(f"{source}: Gemma-4 rope 'factor' != 1 is not supported")
    return RopeConfig(
        theta=float(p.get("rope_theta", theta)),
        rotary_dim=head_dim,
        kind=kind,
        proportion=float(p.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0,
    )


def _gguf_metadata(m: GgufMeta) -> dict[str, Any]:
    """The converter keeps each layer type's geometry in its own keys (``key_length`` /
    ``head_count_kv`` entries of the global layers, ``*_swa`` and the sliding entries for the
    others), which layers slide in ``sliding_window_pattern``, and the global layers'
    proportional rope as ``rope_freqs`` (1 for a rotated pair, 1e30 for one left as is). A
    global layer without ``attn_v`` takes V = K (``attention_k_eq_v``)."""
    n, source = m.n, m.source
    if not int(m.get("expert_count", 0) or 0):
        raise ConfigError(f"{source}: a Gemma-4 file without experts (dense) is not supported")
    if int(m.get("embedding_length_per_layer_input", 0) or 0):
        raise ConfigError(
            f"{source}: Gemma-4 with per-layer input embeddings (E2B / E4B) is not supported "
            "from GGUF"
        )
    pattern = m.get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) < n:
        raise ConfigError(
            f"{source}: 'gemma4.attention.sliding_window_pattern' must list {n} layers"
        )
    sliding = [bool(x) for x in pattern[:n]]
    kv = m.get("attention.head_count_kv", int(m.get("attention.head_count")))
    kv_of = kv if isinstance(kv, list) else [kv] * n
    full = [i for i in range(n) if not sliding[i]]
    swa = [i for i in range(n) if sliding[i]]
    full_dim = int(m.get("attention.key_length"))
    swa_dim = int(m.get("attention.key_length_swa", full_dim))
    partial = 1.0
    read: Callable[[str], Any] | None = m.read
    if read is not None and m.has("rope_freqs.weight"):
        freqs = read("rope_freqs.weight")
        partial = float((freqs < 1e10).sum()) / (full_dim // 2)
    ffn = m.get("feed_forward_length", 0) or 0
    return {
        "head_dim": swa_dim,
        "global_head_dim": full_dim,
        "num_key_value_heads": int(kv_of[swa[0]] if swa else kv_of[0]),
        "per_layer_config": {
            str(i): {"head_dim": full_dim, "num_key_value_heads": int(kv_of[i])} for i in full
        },
        "attention_k_eq_v": bool(full) and all(not m.has(f"blk.{i}.attn_v.weight") for i in full),
        "layer_types": ["sliding_attention" if x else "full_attention" for x in sliding],
        "sliding_window": int(m.get("attention.sliding_window")),
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(m.get("rope.freq_base_swa", 10000.0)),
            },
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": partial,
                "rope_theta": float(m.get("rope.freq_base", 1_000_000.0)),
            },
        },
        "enable_moe_block": True,
        "top_k_experts": int(m.get("expert_used_count")),
        "num_kv_shared_layers": int(m.get("attention.shared_kv_layers", 0) or 0),
        "use_double_wide_mlp": isinstance(ffn, list) and len(set(ffn)) > 1,
        "hidden_size_per_layer_input": 0,
        "final_logit_softcapping": m.get("final_logit_softcapping", None),
        "attention_bias": False,
    }


# Gemma-4's own block names (its four FFN norms, the router's scales, the layer's output
# scale); the rest are the shared ones
_BLOCK = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "layer_output_scale.weight": "layer_scalar",
}

SPEC = FamilySpec(
    architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    hf=HfRules(normalize=_text, layer_types=_layer_types, fields=_fields),
    model="gemma4_model:Gemma4CausalLM",
    gguf=GgufRules(
        arch="gemma4",
        experts_key="num_experts",
        norm_topk=True,
        metadata=_gguf_metadata,
        kv_heads_vary=True,
        block=_BLOCK,
    ),
    tool_syntax="gemma4",
    reasoning_syntax="gemma4_thought",
    renames=((r"^layers\.(\d+)\.experts\.", r"layers.\1.mlp.experts."),),
    ignore=(
        r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio)\.",
        r"^(vision_tower|audio_tower|embed_vision|embed_audio|multi_modal_projector)\.",
    ),
    # Gemma-4's chat markup: a turn ends with <turn|>; thinking sits in a <|channel>...<channel|>
    # block; tool calls in <|tool_call>...<tool_call|>, results in <|tool_response>...
    anchors=(
        ("<turn|>", "end_of_turn"),
        ("<channel|>", "end_of_thinking"),
        ("<|tool_call>", "tool_call_start"),
        ("<tool_call|>", "tool_call_end"),
        ("<|tool_response>", "tool_output_start"),
        ("<tool_response|>", "tool_output_end"),
    ),
)
