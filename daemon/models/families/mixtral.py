"""Mixtral: Llama attention, softmax top-k router with renormalisation, w1/w3/w2 experts."""

from .spec import FamilySpec

SPEC = FamilySpec(
    renames=(
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    )
)
