"""DeepSeek-V3: multi-head latent attention (compressed KV), interleaved rope, sigmoid router
with a score-correction bias and group-limited top-k, unscaled shared experts, the first k
layers dense. The multi-token-prediction layers of the checkpoint are not loaded. Routed
experts released quantized load packed (models/release_quant.py): Kimi-K2-Thinking / K2.5's
INT4 groups (compressed-tensors ``pack-quantized``) as ``q4_0``, NVFP4 ones as ``nvfp4``.

In GGUF it is llama.cpp's ``deepseek2``, whose converter splits ``kv_b_proj`` into
``attn_k_b`` (per head [kv_lora, nope], transposed) and ``attn_v_b`` (per head [v, kv_lora]).
GLM-4.7-Flash (``glm4_moe_lite``) is written under the same name: the metadata hook tells it
apart (``is_glm_flash``) and reads it as that family.

Kimi-K2, K2-Thinking and the text model of K2.5 (``KimiK25ForConditionalGeneration``, whose
release spells its tensors ``language_model.model.*``) are this architecture with Kimi's
tokenizer (a tiktoken rank file, ``engine/tiktoken_vocab.py``; llama.cpp's ``kimi-k2``
pre-tokenizer in GGUF). Their chat templates
spell Kimi's tool-call section, from which the server picks Kimi's output syntax
(``detect_syntax``: ``kimi_k2`` calls, ``<think>`` reasoning where the template has it); the
anchors are Kimi's markers (``kimi_markup``), which DeepSeek's own tokenizer does not have.
DeepSeek-V3's own tool-call markup (``<｜tool▁calls▁begin｜>``) is not parsed: with its own
template the output is plain text."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..config import ConfigError, ModelConfig
from ..gguf_read import SHARED_EXPERT, SIGMOID, GgufMeta, Target
from .kimi_markup import KIMI_ANCHORS
from .spec import FamilySpec, GgufJoin, GgufRules, HfRules

if TYPE_CHECKING:
    import torch


def first_k_dense(text: dict[str, Any], n: int, source: str) -> tuple[bool, ...]:
    """The first ``first_k_dense_replace`` layers dense, the rest sparse."""
    first_dense = int(text.get("first_k_dense_replace") or 0)
    return tuple(i >= first_dense for i in range(n))


def _gguf_metadata(m: GgufMeta) -> dict[str, Any]:
    return mla_gguf_fields(m)


def mla_gguf_fields(m: GgufMeta, gating_default: int = 1) -> dict[str, Any]:
    """DeepSeek-V3's MLA and router from llama.cpp's keys. Files written since the converter
    splits kv_b carry the MLA head sizes in ``key_length_mla`` / ``value_length_mla`` (and 1 KV
    head, kv_lora + rope key length); older ones in ``key_length`` / ``value_length``.
    ``gating_default``: the router a file without ``expert_gating_func`` has (llama.cpp's
    deepseek2 reads softmax, DeepSeek-V2's; the converter writes the key only where the
    checkpoint's config.json names ``scoring_func``)."""
    if int(m.get("expert_gating_func", gating_default)) != SIGMOID:
        raise ConfigError(
            f"{m.source}: {m.arch} with a softmax router (DeepSeek-V2) is not supported; "
            "only the sigmoid router of DeepSeek-V3"
        )
    rope_dim = int(m.get("rope.dimension_count"))
    qk = int(m.get("attention.key_length_mla", 0) or m.get("attention.key_length"))
    heads = int(m.get("attention.head_count"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.get("rope.freq_base"))}
    if m.get("rope.scaling.type", None) == "yarn":
        mscale_all = float(m.get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope.update(
            rope_type="yarn",
            factor=float(m.get("rope.scaling.factor")),
            original_max_position_embeddings=int(m.get("rope.scaling.original_context_length")),
            beta_fast=float(m.get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(m.get("rope.scaling.yarn_beta_slow", 1.0)),
            # the file keeps only mscale_all_dim; DeepSeek-V3's config has mscale equal to it
            mscale=mscale_all,
            mscale_all_dim=mscale_all,
        )
    out = {
        "num_key_value_heads": heads,  # MLA: as many KV heads as query heads, in HF's terms
        "head_dim": qk,
        "q_lora_rank": int(m.get("attention.q_lora_rank", 0) or 0) or None,
        "kv_lora_rank": int(m.get("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk - rope_dim,
        "v_head_dim": int(
            m.get("attention.value_length_mla", 0) or m.get("attention.value_length")
        ),
        "first_k_dense_replace": int(m.get("leading_dense_block_count", 0)),
        "n_group": int(m.get("expert_group_count", 1)),
        "topk_group": int(m.get("expert_group_used_count", 1)),
        "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0)),
        "n_shared_experts": int(m.get("expert_shared_count", 0)),
        "rope_interleave": True,  # the converter keeps DeepSeek's interleaved rope rows
        "rope_parameters": rope,
    }
    if is_glm_flash(m.meta):
        out.update(_glm_flash(m))
    return out


def is_glm_flash(meta: dict[str, Any]) -> bool:
    """A ``deepseek2`` file that is GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``: llama.cpp writes it
    as DeepSeek-V2/V3): told by its GLM pre-tokenizer, by its name, or by the GLM chat markup
    (``[gMASK]<sop>``) of its template."""
    if meta.get("general.architecture") != "deepseek2":
        return False
    if meta.get("tokenizer.ggml.pre") == "glm4":
        return True
    names = " ".join(
        str(meta.get(k) or "")
        for k in ("general.basename", "general.name", "general.base_model.0.name")
    ).lower()
    if re.search(r"\bglm", names):
        return True
    template = meta.get("tokenizer.chat_template")
    return isinstance(template, str) and "[gMASK]" in template and "<|assistant|>" in template


def _glm_flash(m: GgufMeta) -> dict[str, Any]:
    """GLM-4.7-Flash's own fields over DeepSeek's: which layers are dense (those without a
    router; transformers' ``mlp_layer_types``)."""
    return {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "mlp_layer_types": [
            "sparse" if m.has(f"blk.{i}.ffn_gate_inp.weight") else "dense" for i in range(m.n)
        ],
    }


# the split kv_b: read together into kv_b_proj (``join_kv_b``)
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")
MLA_BLOCK = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "exp_probs_b.bias": "mlp.score_bias",
}


def join_kv_b(cfg: ModelConfig, k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """DeepSeek's ``attn_k_b`` [heads, kv_lora, nope] and ``attn_v_b`` [heads, v, kv_lora] back
    into ``kv_b_proj`` [heads * (nope + v), kv_lora]."""
    # deferred: torch (config_hf imports every family module and runs without torch)
    import torch

    h, r = cfg.num_heads, cfg.kv_lora_rank
    k = k_b.reshape(h, r, cfg.qk_nope_head_dim).transpose(1, 2)
    v = v_b.reshape(h, cfg.v_head_dim, r)
    return torch.cat([k, v], dim=1).reshape(-1, r)


def mla_block_split(cfg: ModelConfig, key: str) -> list[Target] | None:
    """``GgufRules.block_split``: the split kv_b's parts are read together (``join_kv_b``)."""
    return [] if key in KV_B_PARTS else None


SPEC = FamilySpec(
    # Kimi-K2.5's multimodal wrapper, served text-only (its ``text_config`` is this family): the
    # release's name and transformers' (``Kimi_K25...``); the vision tower and projector are
    # read past
    architectures=(
        "DeepseekV3ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "Kimi_K25ForConditionalGeneration",
    ),
    hf=HfRules(
        # the original DeepSeek-V3 configs predate rope_interleave, for one
        defaults=dict(
            rope_interleave=True,
            q_lora_rank=1536,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            first_k_dense_replace=3,
        ),
        fixed={"router_kind": "sigmoid_group"},
        mla=True,
        grouped_router=True,
        shared_expert="plain",
        norm_topk_default=True,
        moe_layers=first_k_dense,
    ),
    gguf=GgufRules(
        arch="deepseek2",
        experts_key="n_routed_experts",
        norm_topk=False,
        metadata=_gguf_metadata,
        block={**SHARED_EXPERT, **MLA_BLOCK},
        block_split=mla_block_split,
        joins=(GgufJoin(KV_B_PARTS, "self_attn.kv_b_proj.weight", "attn_kv_b.weight", join_kv_b),),
    ),
    renames=(
        # transformers 5.25 saves Kimi-K2.5's decoder layers as ``language_model.model.blocks.N``
        # (its vision tower's blocks -> layers rename, reversed) and reads them back
        (r"^blocks\.(\d+)\.", r"layers.\1."),
        (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
        (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.score_bias"),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    ),
    ignore=(r"^(model\.)?vision_tower\.", r"^(model\.)?mm_projector\."),
    anchors=KIMI_ANCHORS,
)
