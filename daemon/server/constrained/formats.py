"""xgrammar structural tags for a FORCED tool call in each model's own syntax.

The grammar starts at the first generated token: no free text, exactly one call to one of
the allowed tools, arguments valid under that tool's JSON schema, then the model's stop
token. So even a random-weight model emits a call the parser accepts. (Reasoning is switched
off for such requests when the template allows it: see the request renderer.)
"""

from __future__ import annotations

import json
from typing import Any

from xgrammar.structural_tag import (
    ConstStringFormat,
    JSONSchemaFormat,
    OrFormat,
    SequenceFormat,
    StructuralTag,
)

from ..parsers.deepseek_dsml import BLOCK_V3_2, BLOCK_V4, DSML
from ..parsers.registry import ToolSyntax

EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
# at most one whitespace character in a row between JSON tokens: keeps a weak model from
# spending its max_tokens on indentation inside the grammar
_WS = 1


def _call_format(syntax: ToolSyntax, name: str, schema: dict[str, Any]) -> SequenceFormat:
    """``begin + arguments + end`` for one tool, as the syntax's parser reads it."""
    if syntax is ToolSyntax.QWEN3_JSON:
        begin = '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '
        args = JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=_WS)
        end = "}\n</tool_call>"
    elif syntax is ToolSyntax.QWEN3_XML:
        begin = f"<tool_call>\n<function={name}>\n"
        args = JSONSchemaFormat(json_schema=schema, style="qwen_xml", max_whitespace_cnt=_WS)
        end = "\n</function>\n</tool_call>"
    elif syntax is ToolSyntax.GLM_XML:
        begin = f"<tool_call>{name}\n"
        args = JSONSchemaFormat(json_schema=schema, style="glm_xml", max_whitespace_cnt=_WS)
        end = "</tool_call>"
    elif syntax is ToolSyntax.MINIMAX_XML:
        begin = f'<minimax:tool_call>\n<invoke name="{name}">\n'
        args = JSONSchemaFormat(json_schema=schema, style="minimax_xml", max_whitespace_cnt=_WS)
        end = "</invoke>\n</minimax:tool_call>"
    elif syntax is ToolSyntax.GEMMA4:
        begin = f"<|tool_call>call:{name}"
        args = JSONSchemaFormat(json_schema=schema, style="gemma", max_whitespace_cnt=_WS)
        end = "<tool_call|>"
    elif syntax in (ToolSyntax.DEEPSEEK_DSML, ToolSyntax.DEEPSEEK_DSML_V3_2):
        begin, end = _dsml_frame(syntax, name)
        args = JSONSchemaFormat(json_schema=schema, style="deepseek_xml", max_whitespace_cnt=_WS)
    elif syntax is ToolSyntax.HARMONY:
        # The closing <|call|> is the stop token the matcher requires after the grammar.
        begin = f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
        args = JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=_WS)
        end = ""
    else:
        raise ValueError(f"this model has no tool-call syntax ({syntax.value})")
    elements: list[Any] = [ConstStringFormat(value=begin), args]
    if end:
        elements.append(ConstStringFormat(value=end))
    return SequenceFormat(elements=elements)


def _dsml_frame(syntax: ToolSyntax, name: str) -> tuple[str, str]:
    """DeepSeek's DSML block around one invocation, as its templates write it: ``\\n\\n``
    before the block (markup the parser drops), ``tool_calls`` for V4, ``function_calls``
    for V3.2; xgrammar's ``deepseek_xml`` style writes the parameters."""
    v3_2 = syntax is ToolSyntax.DEEPSEEK_DSML_V3_2
    block = f"{DSML}{BLOCK_V3_2 if v3_2 else BLOCK_V4}"
    begin = f'\n\n<{block}>\n<{DSML}invoke name="{name}">\n'
    return begin, f"</{DSML}invoke>\n</{block}>"


def forced_tool_call(syntax: ToolSyntax, tools: list[tuple[str, dict[str, Any] | None]]) -> str:
    """The structural tag (JSON text) forcing one call to one of ``tools`` (name, schema)."""
    if not tools:
        raise ValueError("a forced tool call needs at least one tool")
    calls = [_call_format(syntax, name, schema or EMPTY_OBJECT) for name, schema in tools]
    fmt: Any = calls[0] if len(calls) == 1 else OrFormat(elements=list(calls))
    return StructuralTag(format=fmt).model_dump_json()
