"""The chat markup of DeepSeek-V3.2 and DeepSeek-V4 as snapshot anchors (ARCHITECTURE §5.2),
for the family module that will serve them (no such family exists yet).

Their chat templates frame a conversation with the special tokens ``<｜User｜>``,
``<｜Assistant｜>`` and ``<｜end▁of▁sentence｜>``, and thinking with ``<think>``/``</think>``.
Tool calls are written in "DSML" (server/parsers/deepseek_dsml.py): tags such as
``<｜DSML｜tool_calls>`` are NOT single tokens: the tokenizer has ``｜DSML｜`` as one token and
spells the rest (``<``, ``tool_calls>``) in ordinary pieces. ``｜DSML｜`` itself appears in every
tag of a call (and in the tool instructions of the system prompt), so it marks no boundary, and
the tool-call kinds (``tool_call_start``, ``tool_call_end``) have no token to stand on. Tool
results are plain text too (``<tool_result>`` in V4, ``<function_results>`` in V3.2). So only
the turn and thinking boundaries are anchors.

No import of ``server``: this module sits below it.
"""

from __future__ import annotations

DEEPSEEK_DSML_ANCHORS = (
    # ends the system prompt and every assistant turn
    ("<｜User｜>", "end_of_turn"),
    # ends every user turn (V4 renders tool results inside the user turn)
    ("<｜Assistant｜>", "end_of_turn"),
    # ends an assistant turn in history (V3.2 follows it with tool results, no <｜User｜>)
    ("<｜end▁of▁sentence｜>", "end_of_turn"),
    ("</think>", "end_of_thinking"),
)
