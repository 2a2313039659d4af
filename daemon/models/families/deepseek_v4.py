"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): its own top level (models/deepseek_v4_model.py,
``DeepseekV4CausalLM``), whose geometry (layer types, compress rates, indexer, hyper-connections,
hash layers, the two ropes) stays in ``ModelConfig.raw`` and is read by `v4_config`. The
ModelConfig fields say what the engine's generic parts need: every layer has the sliding
window (``layer_types`` all sliding, V4's own types in raw), the routed experts use the clamped
SwiGLU (``Activation.SWIGLU_CLAMP`` with ``swiglu_limit``), one shared expert of the routed
width.

Checkpoints: the names of the release, which transformers 5.25 also writes (under ``model.``,
``head.weight`` outside it), so the weight prefix is empty and the renames place every name;
the routed experts (``ffn.experts.<e>.w1 / w3 / w2``) go to the expert banks, the hash layers'
``tid2eid`` tables to integer buffers. MTP layers (``mtp.<i>.``) are skipped. Only
config.json files as transformers writes them are read: the release's own spellings
(``compress_ratios``, ``num_hash_layers``, flat rope keys) are refused. No GGUF mapping yet.

Chat markup: DSML tool calls and <think> reasoning (families/deepseek_markup.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, ModelConfig, RopeConfig
from .deepseek_markup import DEEPSEEK_DSML_ANCHORS
from .spec import FamilySpec, HfRules

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]  # SLIDING | CSA | HCA per layer
    compress_rates: tuple[int, ...]  # per layer, 0 for sliding layers
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    hash_layers: tuple[bool, ...]  # per layer: routed by the token-id table
    swiglu_limit: float
    rope_main: RopeConfig  # sliding layers
    rope_compress: RopeConfig  # CSA / HCA layers, their compressors and indexers
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"


def _rope_config(p: Mapping[str, Any], rotary_dim: int) -> RopeConfig:
    kind = p.get("rope_type", p.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=float(p["rope_theta"]), rotary_dim=rotary_dim, interleaved=True)
    if kind != "yarn":
        raise ConfigError(f"DeepSeek-V4 rope type {kind!r} is not supported")
    return RopeConfig(
        theta=float(p["rope_theta"]),
        rotary_dim=rotary_dim,
        kind="yarn",
        factor=float(p["factor"]),
        original_max_position=int(p["original_max_position_embeddings"]),
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        # transformers 5.25 reads ``truncate`` from the outer {"main", "compress"} dict, where
        # it never is: the correction range is always truncated
        truncate=True,
        # transformers' config forces 1.0 for V4's compress rope (the cos/sin are not scaled)
        attention_factor=float(p.get("attention_factor", 1.0)),
        interleaved=True,
    )


def v4_config(hf: Mapping[str, Any]) -> V4Config:
    """Our V4Config from a config.json as transformers 5.25 writes it (``layer_types``,
    ``compress_rates``, ``mlp_layer_types``, ``partial_rotary_factor`` and the nested
    {"main", "compress"} ``rope_parameters`` already filled in). The release checkpoint's legacy
    keys (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, flat rope params) are
    not read (yet)."""
    for key, want in (
        ("scoring_func", "sqrtsoftplus"),
        ("hidden_act", "silu"),
        ("mlp_bias", False),
    ):
        if hf.get(key, want) != want:
            raise ConfigError(
                f"DeepSeek-V4 with {key}={hf[key]!r} is not supported (only {want!r})"
            )
    n = int(hf["num_hidden_layers"])
    head_dim = int(hf["head_dim"])
    rotary = int(head_dim * float(hf["partial_rotary_factor"]))
    types = tuple(hf["layer_types"][:n])
    rates = tuple(0 if t == SLIDING else int(hf["compress_rates"][t]) for t in types)
    ropes = hf["rope_parameters"]
    return V4Config(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=n,
        num_heads=int(hf["num_attention_heads"]),
        head_dim=head_dim,
        q_lora_rank=int(hf["q_lora_rank"]),
        o_groups=int(hf["o_groups"]),
        o_lora_rank=int(hf["o_lora_rank"]),
        sliding_window=int(hf["sliding_window"]),
        rms_norm_eps=float(hf["rms_norm_eps"]),
        layer_types=types,
        compress_rates=rates,
        index_heads=int(hf["index_n_heads"]),
        index_head_dim=int(hf["index_head_dim"]),
        index_topk=int(hf["index_topk"]),
        hc_mult=int(hf["hc_mult"]),
        hc_sinkhorn_iters=int(hf["hc_sinkhorn_iters"]),
        hc_eps=float(hf["hc_eps"]),
        num_experts=int(hf["n_routed_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        hash_layers=tuple(t == "hash_moe" for t in hf["mlp_layer_types"][:n]),
        swiglu_limit=float(hf["swiglu_limit"]),
        rope_main=_rope_config(ropes["main"], rotary),
        rope_compress=_rope_config(ropes["compress"], rotary),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
    )


# Checkpoint tensor names (the release's, which transformers 5.25 also writes, then under a
# "model." prefix for all but head.weight) -> ours: top-level, and under layers.<i>.
TOP_NAMES = {
    "embed.weight": "embed_tokens.weight",
    "embed_tokens.weight": "embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.fn",
    "hc_head_base": "hc_head.base",
    "hc_head_scale": "hc_head.scale",
    "hc_head.hc_fn": "hc_head.fn",
    "hc_head.hc_base": "hc_head.base",
    "hc_head.hc_scale": "hc_head.scale",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.indexer.wq_b.weight": "self_attn.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
    "ffn.gate.weight": "mlp.router.weight",
    "ffn.gate.bias": "mlp.router.score_bias",
    "ffn.gate.tid2eid": "mlp.router.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
}
for _hc in ("attn", "ffn"):
    for _p in ("fn", "base", "scale"):
        LAYER_NAMES[f"hc_{_hc}_{_p}"] = f"{_hc}_hc.{_p}"
for _src, _dst in (
    ("attn.compressor.", "self_attn.compressor."),
    ("attn.indexer.compressor.", "self_attn.indexer.compressor."),
):
    for _a, _b in (
        ("wkv.weight", "kv_proj.weight"),
        ("wgate.weight", "gate_proj.weight"),
        ("ape", "position_bias"),
        ("norm.weight", "kv_norm.weight"),
    ):
        LAYER_NAMES[_src + _a] = _dst + _b


def _text(text: dict[str, Any], source: str) -> dict[str, Any]:
    """Refuses what V4 does not compute (``v4_config``'s checks, the geometry keys it reads);
    then the generic reader's view: every layer sliding, the main rope flat."""
    try:
        v4 = v4_config(text)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(
            f"{source}: not a DeepSeek-V4 config.json as transformers writes it ({e!r}; the "
            "release's own spellings are not read yet)"
        ) from None
    main = dict(text["rope_parameters"]["main"])
    main.setdefault("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    out = {**text, "layer_types": [SLIDING] * v4.num_layers, "rope_parameters": main}
    out.pop("qk_rope_head_dim", None)  # not MLA's: the rope dim follows partial_rotary_factor
    out["rope_interleave"] = True
    return out


def _fields(text: dict[str, Any], cfg: ModelConfig, source: str) -> dict[str, Any]:
    """The router's scale and the one shared expert (for the planner's sizes; the model builds
    it from V4Config), the query LoRA rank."""
    return dict(
        routed_scaling_factor=float(text["routed_scaling_factor"]),
        shared_expert_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_gated=False,
        q_lora_rank=int(text["q_lora_rank"]),
    )


def _renames() -> tuple[tuple[str, str], ...]:
    out = [(r"^model\.", "")]
    out += [(f"^{re.escape(k)}$", v) for k, v in TOP_NAMES.items()]
    out += [
        (rf"^layers\.(\d+)\.{re.escape(k)}$", rf"layers.\1.{v}") for k, v in LAYER_NAMES.items()
    ]
    # routed experts: w1 gate, w3 up, w2 down -> the loader's per-expert names (expert banks)
    for w, proj in (("1", "gate_proj"), ("3", "up_proj"), ("2", "down_proj")):
        out.append(
            (rf"^layers\.(\d+)\.ffn\.experts\.(\d+)\.w{w}\.", rf"layers.\1.mlp.experts.\2.{proj}.")
        )
    return tuple(out)


SPEC = FamilySpec(
    architectures=("DeepseekV4ForCausalLM",),
    hf=HfRules(
        fixed=dict(
            activation="swiglu_clamp",
            router_kind="sqrtsoftplus",  # or the token-id hash (hash layers): V4Router
            norm_topk_prob=True,  # V4 always renormalises the top-k
            weight_prefix="",
        ),
        normalize=_text,
        fields=_fields,
    ),
    model="deepseek_v4_model:DeepseekV4CausalLM",
    tool_syntax="deepseek_dsml",
    reasoning_syntax="think",
    renames=_renames(),
    mtp=r"^(model\.)?mtp\.\d+\.",
    anchors=DEEPSEEK_DSML_ANCHORS,
)
