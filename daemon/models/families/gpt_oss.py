"""GPT-OSS: attention sinks, alternating sliding-window layers, q/k/v/o and expert biases,
YaRN rope, softmax over the top-k router logits, clamped SwiGLU with interleaved gate/up."""

from .spec import FamilySpec

SPEC = FamilySpec(
    experts_transposed_interleaved=True,
    anchors=(
        ("<|end|>", "end_of_turn"),
        ("<|call|>", "tool_call_end"),
        ("<|return|>", "end_of_turn"),
    ),
)
