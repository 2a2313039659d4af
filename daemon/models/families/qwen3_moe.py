"""Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k router (optional renormalisation),
optional dense MLP layers (decoder_sparse_step / mlp_only_layers)."""

from __future__ import annotations

from typing import Any

from ..gguf_read import GgufMeta, routerless_layers
from .spec import CHATML_ANCHORS, CHATML_TURN_HEADER, FamilySpec, GgufRules, HfRules


def sparse_step(text: dict[str, Any], n: int, source: str) -> tuple[bool, ...]:
    """transformers' Qwen rule: every ``decoder_sparse_step``-th layer is sparse, unless listed
    in ``mlp_only_layers``."""
    step = int(text.get("decoder_sparse_step", 1) or 1)
    dense = set(text.get("mlp_only_layers") or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))


def dense_layers(m: GgufMeta) -> dict[str, Any]:
    """llama.cpp keeps no sparse step: the layers without a router are the dense ones."""
    return {"mlp_only_layers": routerless_layers(m)}


SPEC = FamilySpec(
    architectures=("Qwen3MoeForCausalLM",),
    hf=HfRules(fixed={"qk_norm": "head"}, moe_layers=sparse_step),
    gguf=GgufRules(
        arch="qwen3moe", experts_key="num_experts", norm_topk=True, metadata=dense_layers
    ),
    tool_syntax="qwen3_json",
    reasoning_syntax="think",
    renames=((r"\.mlp\.gate\.weight$", ".mlp.router.weight"),),
    anchors=CHATML_ANCHORS,
    turn_header=CHATML_TURN_HEADER,
)
