"""GLM-4.5 / 4.6 / 4.7 (Glm4Moe): GQA with q/k/v biases but no output bias, partial rotary
(half of each head by default), optional per-head q/k RMSNorm, the DeepSeek-V3 router (sigmoid
scores, score-correction bias, group-limited top-k, routed scaling) with unscaled, ungated
shared experts, the first k layers dense. Multi-token-prediction layers stored after the last
decoder layer are skipped by the loader."""

from .spec import FamilySpec

# The GLM-4.5 chat markup. The model ends an assistant turn by emitting <|user|> (or
# <|observation|> when it called tools: the tool results follow as an observation turn).
GLM_ANCHORS = (
    ("<|user|>", "end_of_turn"),
    ("<|observation|>", "end_of_turn"),
    ("<|endoftext|>", "end_of_turn"),
    ("</think>", "end_of_thinking"),
    ("<tool_call>", "tool_call_start"),
    ("</tool_call>", "tool_call_end"),
    ("<tool_response>", "tool_output_start"),
    ("</tool_response>", "tool_output_end"),
)

SPEC = FamilySpec(
    renames=(
        (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
        (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.score_bias"),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    ),
    anchors=GLM_ANCHORS,
)
