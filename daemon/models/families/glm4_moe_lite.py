"""GLM-4.7-Flash (Glm4MoeLite): DeepSeek-V3's multi-head latent attention and grouped sigmoid
router in a GLM checkpoint; which layers are dense is listed in ``mlp_layer_types``. Shares the
GLM-4.5 chat markup.

No GGUF rules of its own: llama.cpp writes it as ``deepseek2``, read by ``deepseek_v3``'s rules,
whose metadata hook names this family's architecture for such a file."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError
from .glm4_moe import GLM_ANCHORS
from .spec import FamilySpec, HfRules


def _moe_layers(text: dict[str, Any], n: int, source: str) -> tuple[bool, ...]:
    kinds = text.get("mlp_layer_types")
    if kinds is None:  # transformers' default: the first layer dense, then sparse
        return tuple(i >= 1 for i in range(n))
    if not isinstance(kinds, list) or len(kinds) != n:
        raise ConfigError(f"{source}: field 'mlp_layer_types' must list {n} entries")
    return tuple(k == "sparse" for k in kinds)


SPEC = FamilySpec(
    architectures=("Glm4MoeLiteForCausalLM",),
    hf=HfRules(
        defaults=dict(
            rope_interleave=True,
            q_lora_rank=768,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.8,
            n_shared_experts=1,
            num_nextn_predict_layers=1,  # transformers skips model.layers.<n> of GLM-4.7-Flash
        ),
        fixed={"router_kind": "sigmoid_group"},
        mla=True,
        grouped_router=True,
        shared_expert="plain",
        norm_topk_default=True,
        moe_layers=_moe_layers,
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
