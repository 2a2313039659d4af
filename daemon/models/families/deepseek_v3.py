"""DeepSeek-V3: multi-head latent attention (compressed KV), interleaved rope, sigmoid router
with a score-correction bias and group-limited top-k, unscaled shared experts, the first k
layers dense. The multi-token-prediction layers of the checkpoint are not loaded."""

from .spec import FamilySpec

SPEC = FamilySpec(
    renames=(
        (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
        (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.score_bias"),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    ),
)
