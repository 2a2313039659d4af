"""GPT-OSS: attention sinks, alternating sliding-window layers, q/k/v/o and expert biases,
YaRN rope, softmax over the top-k router logits, clamped SwiGLU with interleaved gate/up."""

from __future__ import annotations

from typing import Any

from ..gguf_read import GgufMeta, yarn
from .spec import FamilySpec, GgufRules, HfRules


def _layer_types(text: dict[str, Any], n: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def _gguf_metadata(m: GgufMeta) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.get("rope.freq_base"))}
    # GPT-OSS's YaRN keeps the fractional correction range
    rope.update(yarn(m, truncate=False))
    return {
        "rope_parameters": rope,
        "sliding_window": int(m.get("attention.sliding_window")),
        "attention_bias": True,
    }


SPEC = FamilySpec(
    architectures=("GptOssForCausalLM",),
    hf=HfRules(
        defaults={"attention_bias": True},
        fixed={
            "attention_sinks": True,
            "router_bias": True,
            "expert_bias": True,
            "activation": "gptoss",
            "router_kind": "topk_softmax",
            "norm_topk_prob": True,  # the softmax over the top-k logits
        },
        layer_types=_layer_types,
    ),
    gguf=GgufRules(
        arch="gpt-oss", experts_key="num_local_experts", norm_topk=True, metadata=_gguf_metadata
    ),
    tool_syntax="harmony",
    reasoning_syntax="harmony",
    experts_transposed_interleaved=True,
    anchors=(
        ("<|end|>", "end_of_turn"),
        ("<|call|>", "tool_call_end"),
        ("<|return|>", "end_of_turn"),
    ),
)
