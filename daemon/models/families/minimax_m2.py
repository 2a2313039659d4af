"""MiniMax-M2 / M2.5: GQA with q/k RMSNorm over all heads at once (before the head split),
partial rotary (``rotary_dim``), a sigmoid router whose choice adds a score-correction bias (no
groups, always renormalised), w1/w3/w2 experts under ``block_sparse_moe``, no shared expert."""

from .spec import FamilySpec

SPEC = FamilySpec(
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
