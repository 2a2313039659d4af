"""GLM-4.7-Flash (Glm4MoeLite): DeepSeek-V3's multi-head latent attention and grouped sigmoid
router in a GLM checkpoint; which layers are dense is listed in ``mlp_layer_types``. Shares the
GLM-4.5 chat markup."""

from .glm4_moe import GLM_ANCHORS
from .spec import FamilySpec

SPEC = FamilySpec(
    renames=(
        (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
        (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.score_bias"),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    ),
    anchors=GLM_ANCHORS,
)
