"""Qwen3.5 / Qwen3.6 MoE hybrids: Gated DeltaNet and gated full attention, (1 + w) RMSNorm,
routed experts plus a shared expert behind a sigmoid gate. Multimodal wrappers are served
text-only (the vision tower and the MTP head are not loaded)."""

from .spec import CHATML_ANCHORS, FamilySpec

SPEC = FamilySpec(
    renames=((r"\.mlp\.gate\.weight$", ".mlp.router.weight"),),
    anchors=CHATML_ANCHORS,
    ignore=(r"^mtp\.", r"^model\.visual\.", r"^visual\."),
)
