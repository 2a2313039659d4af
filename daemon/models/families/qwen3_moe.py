"""Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k router (optional renormalisation),
optional dense MLP layers (decoder_sparse_step / mlp_only_layers)."""

from .spec import CHATML_ANCHORS, FamilySpec

SPEC = FamilySpec(
    renames=((r"\.mlp\.gate\.weight$", ".mlp.router.weight"),),
    anchors=CHATML_ANCHORS,
)
