"""Qwen3.5 / Qwen3.6 MoE hybrids: Gated DeltaNet and gated full attention, (1 + w) RMSNorm,
routed experts plus a shared expert behind a sigmoid gate. Multimodal wrappers are served
text-only (the vision tower and the MTP head are not loaded). Every layer's FFN is sparse.
The HF and GGUF rules are Qwen3-Next's (``qwen3_next``), with the value heads tiled in GGUF."""

from .qwen3_next import HYBRID_FIXED, hybrid_gguf, hybrid_layer_types, hybrid_metadata
from .spec import CHATML_ANCHORS, CHATML_TURN_HEADER, FamilySpec, HfRules

SPEC = FamilySpec(
    architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    hf=HfRules(
        fixed=HYBRID_FIXED,
        shared_expert="gated",
        norm_topk_default=True,
        layer_types=hybrid_layer_types,
    ),
    gguf=hybrid_gguf("qwen35moe", tiled=True, metadata=hybrid_metadata),
    tool_syntax="qwen3_xml",
    reasoning_syntax="think",
    renames=((r"\.mlp\.gate\.weight$", ".mlp.router.weight"),),
    anchors=CHATML_ANCHORS,
    turn_header=CHATML_TURN_HEADER,
    ignore=(r"^mtp\.", r"^model\.visual\.", r"^visual\."),
)
