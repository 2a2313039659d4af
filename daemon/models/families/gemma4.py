"""Gemma-4 with the MoE block (26B-A4B): see `gemma4_model` and `layers.gemma4`. The routed
experts are stored beside the layer's dense MLP (``layers.<i>.experts.gate_up_proj`` [E, 2I, H],
gate rows then up rows); the router is the layer's ``router`` module. The multimodal wrapper is
served text-only: its vision and audio towers and their embedders are not loaded."""

from .spec import FamilySpec

SPEC = FamilySpec(
    renames=((r"^layers\.(\d+)\.experts\.", r"layers.\1.mlp.experts."),),
    ignore=(
        r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio)\.",
        r"^(vision_tower|audio_tower|embed_vision|embed_audio|multi_modal_projector)\.",
    ),
    # Gemma-4's chat markup: a turn ends with <turn|>; thinking sits in a <|channel>...<channel|>
    # block; tool calls in <|tool_call>...<tool_call|>, results in <|tool_response>...
    anchors=(
        ("<turn|>", "end_of_turn"),
        ("<channel|>", "end_of_thinking"),
        ("<|tool_call>", "tool_call_start"),
        ("<tool_call|>", "tool_call_end"),
        ("<|tool_response>", "tool_output_start"),
        ("<tool_response|>", "tool_output_end"),
    ),
)
