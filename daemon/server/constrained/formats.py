"""xgrammar structural tags for a FORCED tool call in each model's own syntax.

The grammar starts at the first generated token: no free text, exactly one call to one of
the allowed tools, arguments valid under that tool's JSON schema, then the model's stop
token. So even a random-weight model emits a call the parser accepts. (Reasoning is switched
off for such requests when the template allows it: see the request renderer.)

No argument string may spell a tag the syntax's parser reads (``</tool_call>`` in a JSON string
ended the call there): the schema's strings exclude them. xgrammar drops a string's
``minLength``/``maxLength`` when it filters it, so a schema with length bounds keeps its bounds
and goes unfiltered (but in Gemma's style, which has no bounds either way); the parsers read
such a tag inside a string or value as text anyway.
"""

from __future__ import annotations

import json
from typing import Any

from xgrammar.structural_tag import (
    ConstStringFormat,
    JSONSchemaFormat,
    OrFormat,
    RegexFormat,
    SequenceFormat,
    StructuralTag,
)

from ..parsers import kimi_k2
from ..parsers.deepseek_dsml import BLOCK_V3_2, BLOCK_V4, DSML
from ..parsers.registry import TOOL_MARKERS, ToolSyntax

EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
# at most one whitespace character in a row between JSON tokens: keeps a weak model from
# spending its max_tokens on indentation inside the grammar
_WS = 1


# the xgrammar style of each syntax's arguments
_STYLE: dict[ToolSyntax, Any] = {
    ToolSyntax.QWEN3_JSON: "json",
    ToolSyntax.QWEN3_XML: "qwen_xml",
    ToolSyntax.GLM_XML: "glm_xml",
    ToolSyntax.MINIMAX_XML: "minimax_xml",
    ToolSyntax.GEMMA4: "gemma",
    ToolSyntax.HARMONY: "json",
    ToolSyntax.DEEPSEEK_DSML: "deepseek_xml",
    ToolSyntax.DEEPSEEK_DSML_V3_2: "deepseek_xml",
    ToolSyntax.KIMI_K2: "json",
}
_LENGTH_BOUNDS = ("minLength", "maxLength")


def has_length_bounds(schema: Any) -> bool:
    """Whether any object in ``schema`` has a minLength or maxLength key (iterative: a schema
    may nest deeply)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if any(k in node for k in _LENGTH_BOUNDS):
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def arguments_format(syntax: ToolSyntax, schema: dict[str, Any]) -> JSONSchemaFormat:
    """The arguments under ``schema`` in the syntax's style, their strings kept free of the
    parser's tags where xgrammar can do that without dropping length bounds."""
    # xgrammar's gemma style has no length bounds to lose (it drops them unfiltered too)
    keep_bounds = syntax is not ToolSyntax.GEMMA4 and has_length_bounds(schema)
    excludes = [] if keep_bounds else list(TOOL_MARKERS[syntax])
    return JSONSchemaFormat(
        json_schema=schema, style=_STYLE[syntax], max_whitespace_cnt=_WS, excludes=excludes
    )


def _call_format(syntax: ToolSyntax, name: str, schema: dict[str, Any]) -> SequenceFormat:
    """``begin + arguments + end`` for one tool, as the syntax's parser reads it."""
    if syntax is ToolSyntax.KIMI_K2:
        return _kimi_call(name, schema)
    if syntax is ToolSyntax.QWEN3_JSON:
        begin = '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '
        end = "}\n</tool_call>"
    elif syntax is ToolSyntax.QWEN3_XML:
        begin = f"<tool_call>\n<function={name}>\n"
        end = "\n</function>\n</tool_call>"
    elif syntax is ToolSyntax.GLM_XML:
        begin = f"<tool_call>{name}\n"
        end = "</tool_call>"
    elif syntax is ToolSyntax.MINIMAX_XML:
        begin = f'<minimax:tool_call>\n<invoke name="{name}">\n'
        end = "</invoke>\n</minimax:tool_call>"
    elif syntax is ToolSyntax.GEMMA4:
        begin = f"<|tool_call>call:{name}"
        end = "<tool_call|>"
    elif syntax in (ToolSyntax.DEEPSEEK_DSML, ToolSyntax.DEEPSEEK_DSML_V3_2):
        begin, end = _dsml_frame(syntax, name)
    elif syntax is ToolSyntax.HARMONY:
        # The closing <|call|> is the stop token the matcher requires after the grammar.
        begin = f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
        end = ""
    else:
        raise ValueError(f"this model has no tool-call syntax ({syntax.value})")
    elements: list[Any] = [ConstStringFormat(value=begin), arguments_format(syntax, schema)]
    if end:
        elements.append(ConstStringFormat(value=end))
    return SequenceFormat(elements=elements)


# the call's index in its id: the model writes it (Kimi-K2-Thinking's template counts the calls
# of the whole conversation, K2-Instruct's those of the message); no leading zeros, bounded
_KIMI_INDEX = "0|[1-9][0-9]{0,3}"


def _kimi_call(name: str, schema: dict[str, Any]) -> SequenceFormat:
    """Kimi-K2's section holding one call, its id ``functions.NAME:IDX`` as the templates
    write it."""
    head = kimi_k2.SECTION_OPEN + kimi_k2.CALL_OPEN + kimi_k2.ID_PREFIX + name + ":"
    elements: list[Any] = [
        ConstStringFormat(value=head),
        RegexFormat(pattern=_KIMI_INDEX),
        ConstStringFormat(value=kimi_k2.ARGS_OPEN),
        arguments_format(ToolSyntax.KIMI_K2, schema),
        ConstStringFormat(value=kimi_k2.CALL_CLOSE + kimi_k2.SECTION_CLOSE),
    ]
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
