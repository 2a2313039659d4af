"""GLM-4.5 / 4.6 / 4.7 (Glm4Moe): GQA with q/k/v biases but no output bias, partial rotary
(half of each head by default), optional per-head q/k RMSNorm, the DeepSeek-V3 router (sigmoid
scores, score-correction bias, group-limited top-k, routed scaling) with unscaled, ungated
shared experts, the first k layers dense. Multi-token-prediction layers stored after the last
decoder layer are skipped by the loader."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..gguf_read import SCORE_BIAS, SHARED_EXPERT, GgufMeta, plain_rope, sigmoid_router
from .deepseek_v3 import first_k_dense
from .spec import FamilySpec, GgufRules, HfRules

# The GLM-4.5 chat markup. The model ends an assistant turn by emitting <|user|> (or
# <|observation|> when it called tools: the tool results follow as an observation turn).
GLM_ANCHORS = (
    ("<|user|>", "end_of_turn"),
    ("<|observation|>", "end_of_turn"),
    ("<|endoftext|>", "end_of_turn"),
    ("</think>", "end_of_thinking"),
    ("<tool_call>", "tool_call_start"),
    ("</tool_call>", "tool_call_end"),
    ("<tool_response>", "tool_output_start"),
    ("</tool_response>", "tool_output_end"),
)


def _fields(text: dict[str, Any], cfg: ModelConfig, source: str) -> dict[str, Any]:
    return {"qk_norm": "head" if text.get("use_qk_norm") else "none"}


def _gguf_metadata(m: GgufMeta) -> dict[str, Any]:
    """Partial rotary (``rope.dimension_count`` of each head), the DeepSeek-V3 router (sigmoid,
    ``exp_probs_b`` correction bias, groups, routed scaling), plain shared experts, the first
    ``leading_dense_block_count`` layers dense. The q/k norms and the q/k/v biases are optional
    in GLM's config: the file has their tensors or not."""
    sigmoid_router(m)
    return {
        "rope_parameters": plain_rope(
            m, m.head_dim, int(m.get("rope.dimension_count", m.head_dim // 2))
        ),
        "first_k_dense_replace": int(m.get("leading_dense_block_count", 0)),
        "n_shared_experts": int(m.get("expert_shared_count", 0)),
        "n_group": int(m.get("expert_group_count", 1) or 1),
        "topk_group": int(m.get("expert_group_used_count", 1) or 1),
        "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0)),
        "use_qk_norm": m.has("blk.0.attn_q_norm.weight"),
        "attention_bias": m.has("blk.0.attn_q.bias"),
    }


SPEC = FamilySpec(
    architectures=("Glm4MoeForCausalLM",),
    hf=HfRules(
        defaults=dict(
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            n_shared_experts=1,
            first_k_dense_replace=1,
            num_nextn_predict_layers=1,
        ),
        fixed={"router_kind": "sigmoid_group", "o_proj_bias": False},
        grouped_router=True,
        shared_expert="plain",
        norm_topk_default=True,
        partial_rotary_default=0.5,
        moe_layers=first_k_dense,
        fields=_fields,
    ),
    # stored as they are (rope in the rotate-half order), the correction bias as exp_probs_b,
    # the multi-token-prediction layer after the decoder layers (skipped)
    gguf=GgufRules(
        arch="glm4moe",
        experts_key="n_routed_experts",
        norm_topk=True,
        metadata=_gguf_metadata,
        block={**SCORE_BIAS, **SHARED_EXPERT},
    ),
    tool_syntax="glm_xml",
    reasoning_syntax="think",
    renames=(
        (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
        (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.score_bias"),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    ),
    anchors=GLM_ANCHORS,
)
