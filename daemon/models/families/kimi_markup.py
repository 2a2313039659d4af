"""The chat markup of Kimi-K2.x (Kimi-K2-Instruct, K2-Thinking, K2.5) as snapshot anchors
(ARCHITECTURE §5.2), for the families that serve Kimi's checkpoints: ``deepseek_v3`` (Kimi-K2's
``DeepseekV3ForCausalLM`` with Kimi's tokenizer) and whichever serves K2.5's
``KimiK25ForConditionalGeneration`` text model.

Kimi's templates frame every message as ``<|im_user|>`` / ``<|im_assistant|>`` /
``<|im_system|>`` + role + ``<|im_middle|>`` + text + ``<|im_end|>`` (tool results are
``<|im_system|>`` messages, ``## Return of functions.NAME:IDX`` + the result), thinking as
``<think>...</think>``, and tool calls as a section of calls between
``<|tool_calls_section_begin|>`` and ``<|tool_calls_section_end|>``
(server/parsers/kimi_k2.py). Each marker is one special token of Kimi's tokenizer.

Kimi's output syntax is picked by its chat template, which spells the section markers
(server/parsers/registry.py ``detect_syntax``): ``KIMI_TOOL_SYNTAX`` and ``<think>`` reasoning.

No import of ``server``: this module sits below it.
"""

from __future__ import annotations

KIMI_TOOL_SYNTAX = "kimi_k2"

KIMI_ANCHORS = (
    # ends every message: system prompt, user turn, assistant turn, tool result
    ("<|im_end|>", "end_of_turn"),
    ("</think>", "end_of_thinking"),
    ("<|tool_calls_section_begin|>", "tool_call_start"),
    ("<|tool_calls_section_end|>", "tool_call_end"),
)
