"""MiniMax-M2 / M2.5: GQA with q/k RMSNorm over all heads at once (before the head split),
partial rotary (``rotary_dim``), a sigmoid router whose choice adds a score-correction bias (no
groups, always renormalised), w1/w3/w2 experts under ``block_sparse_moe``, no shared expert."""

from __future__ import annotations

from typing import Any

from ..gguf_read import SCORE_BIAS, GgufMeta, plain_rope, sigmoid_router
from .spec import FamilySpec, GgufRules, HfRules


def _gguf_metadata(m: GgufMeta) -> dict[str, Any]:
    """Partial rotary as a dim count (``rope.dimension_count``, HF's ``rotary_dim``), the
    sigmoid router with its correction bias, experts of ``expert_feed_forward_length``."""
    sigmoid_router(m)
    rotary = int(m.get("rope.dimension_count", m.head_dim))
    return {
        "rotary_dim": rotary,
        "rope_parameters": plain_rope(m, m.head_dim, rotary),
        "intermediate_size": int(m.get("expert_feed_forward_length")),
    }


SPEC = FamilySpec(
    architectures=("MiniMaxM2ForCausalLM",),
    hf=HfRules(fixed={"router_kind": "sigmoid_group", "qk_norm": "full", "norm_topk_prob": True}),
    # stored as they are (rope in the rotate-half order), the correction bias as exp_probs_b
    gguf=GgufRules(
        arch="minimax-m2",
        experts_key="num_local_experts",
        norm_topk=True,
        metadata=_gguf_metadata,
        block=SCORE_BIAS,
    ),
    tool_syntax="minimax_xml",
    reasoning_syntax="think",
    renames=(
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
        (r"\.mlp\.e_score_correction_bias$", ".mlp.score_bias"),
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    ),
    anchors=(
        ("[e~[", "end_of_turn"),
        ("</think>", "end_of_thinking"),
        ("<minimax:tool_call>", "tool_call_start"),
        ("</minimax:tool_call>", "tool_call_end"),
    ),
)
