"""Which output syntax a model speaks, and the parser for it.

The tool-call syntax is chosen per model:
1. by inspecting the model's chat template for the syntax it instructs the model to use
   (``<minimax:tool_call>`` -> MiniMax XML, ``<arg_key>`` -> GLM, ``<|tool_call>`` -> Gemma-4,
   ``<|tool_calls_section_begin|>`` -> Kimi-K2,
   ``<function=`` -> Qwen XML, ``<tool_call>`` -> Qwen JSON, ``<|channel|>`` -> harmony),
   because one family can ship different templates (the built-in tiny model is family
   ``qwen3_5_moe`` but its template asks for JSON ``<tool_call>``);
2. falling back to the family's default (``family_default``: the names its ``FamilySpec``
   declares) when the template says nothing.
Never from path or model-name substrings.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ...models.registry import SPECS
from . import (
    deepseek_dsml,
    gemma4,
    glm_xml,
    harmony,
    kimi_k2,
    minimax_xml,
    qwen3_json,
    qwen3_xml,
    tagged,
    think,
)
from .base import OutputParser, PassThrough, ToolSchemas
from .chain import Chain
from .think import ThinkParser


class ToolSyntax(StrEnum):
    NONE = "none"
    QWEN3_JSON = "qwen3_json"
    QWEN3_XML = "qwen3_xml"
    HARMONY = "harmony"
    GLM_XML = "glm_xml"
    MINIMAX_XML = "minimax_xml"
    GEMMA4 = "gemma4"
    DEEPSEEK_DSML = "deepseek_dsml"  # DeepSeek-V4: <｜DSML｜tool_calls>
    DEEPSEEK_DSML_V3_2 = "deepseek_dsml_v3_2"  # DeepSeek-V3.2: <｜DSML｜function_calls>
    KIMI_K2 = "kimi_k2"  # Kimi-K2 / K2.5: <|tool_calls_section_begin|>


class ReasoningSyntax(StrEnum):
    NONE = "none"
    THINK = "think"
    HARMONY = "harmony"
    GEMMA4_THOUGHT = "gemma4_thought"  # <|channel>thought ... <channel|>


@dataclass(frozen=True)
class OutputSyntax:
    tools: ToolSyntax
    reasoning: ReasoningSyntax


_PLAIN = OutputSyntax(ToolSyntax.NONE, ReasoningSyntax.NONE)


def family_default(family: str) -> OutputSyntax:
    """The syntax the family declares (``FamilySpec.tool_syntax`` / ``reasoning_syntax``,
    ``models/families/``); none for a family not known."""
    spec = SPECS.get(family)
    if spec is None:
        return _PLAIN
    return OutputSyntax(ToolSyntax(spec.tool_syntax), ReasoningSyntax(spec.reasoning_syntax))


def detect_syntax(family: str, template_source: str) -> OutputSyntax:
    """The syntax the chat template instructs, else the family default."""
    default = family_default(family)
    src = template_source or ""
    if "<|channel|>" in src:
        return OutputSyntax(ToolSyntax.HARMONY, ReasoningSyntax.HARMONY)
    if deepseek_dsml.DSML in src:  # the templates build the tags from a dsml_token variable
        v3_2 = deepseek_dsml.BLOCK_V3_2 in src
        tools = ToolSyntax.DEEPSEEK_DSML_V3_2 if v3_2 else ToolSyntax.DEEPSEEK_DSML
    elif kimi_k2.SECTION_OPEN in src and kimi_k2.CALL_OPEN in src:
        tools = ToolSyntax.KIMI_K2
    elif minimax_xml.OPEN in src:
        tools = ToolSyntax.MINIMAX_XML
    elif "<arg_key>" in src:
        tools = ToolSyntax.GLM_XML
    elif gemma4.OPEN in src:
        tools = ToolSyntax.GEMMA4
    elif "<function=" in src:
        tools = ToolSyntax.QWEN3_XML
    elif "<tool_call>" in src:
        tools = ToolSyntax.QWEN3_JSON
    else:
        tools = default.tools
    if "<think>" in src:
        reasoning = ReasoningSyntax.THINK
    elif gemma4.CHANNEL in src:
        reasoning = ReasoningSyntax.GEMMA4_THOUGHT
    else:
        reasoning = default.reasoning
    if reasoning is ReasoningSyntax.HARMONY:
        reasoning = ReasoningSyntax.NONE  # harmony reasoning needs a harmony template
    return OutputSyntax(tools, reasoning)


# The tags each tool syntax's parser reads inside a call: a forced call's arguments must not
# spell them (the grammar keeps them out of its strings, formats.py), and a tokenizer's special
# token spelling one must reach the parser (the detokenizer keeps it, service.py).
TOOL_MARKERS: dict[ToolSyntax, tuple[str, ...]] = {
    ToolSyntax.QWEN3_JSON: (tagged.OPEN, tagged.CLOSE),
    ToolSyntax.QWEN3_XML: (tagged.OPEN, tagged.CLOSE, *qwen3_xml.TAGS),
    ToolSyntax.GLM_XML: (tagged.OPEN, tagged.CLOSE, *glm_xml.TAGS),
    ToolSyntax.MINIMAX_XML: (minimax_xml.OPEN, minimax_xml.CLOSE, *minimax_xml.TAGS),
    ToolSyntax.GEMMA4: (gemma4.OPEN, gemma4.CLOSE, gemma4.QUOTE),
    ToolSyntax.HARMONY: harmony.ENDS,
    # a DSML tag is ｜DSML｜ between ordinary pieces; a value ends at its parameter's closing tag
    ToolSyntax.DEEPSEEK_DSML: (deepseek_dsml.DSML, deepseek_dsml.PARAM_CLOSE),
    ToolSyntax.DEEPSEEK_DSML_V3_2: (deepseek_dsml.DSML, deepseek_dsml.PARAM_CLOSE),
    ToolSyntax.KIMI_K2: kimi_k2.TAGS,
}
REASONING_MARKERS: dict[ReasoningSyntax, tuple[str, ...]] = {
    ReasoningSyntax.THINK: (think.OPEN, think.CLOSE),
    ReasoningSyntax.GEMMA4_THOUGHT: (gemma4.CHANNEL, gemma4.THOUGHT_CLOSE),
}


def parser_markers(syntax: OutputSyntax) -> tuple[str, ...]:
    """Every tag the output parser of ``syntax`` reads (tool calls and reasoning)."""
    return TOOL_MARKERS.get(syntax.tools, ()) + REASONING_MARKERS.get(syntax.reasoning, ())


_TOOL_PARSERS = {
    ToolSyntax.QWEN3_JSON: qwen3_json.make_parser,
    ToolSyntax.QWEN3_XML: qwen3_xml.make_parser,
    ToolSyntax.GLM_XML: glm_xml.make_parser,
    ToolSyntax.MINIMAX_XML: minimax_xml.make_parser,
    ToolSyntax.GEMMA4: gemma4.make_parser,
    ToolSyntax.DEEPSEEK_DSML: deepseek_dsml.make_parser,
    ToolSyntax.DEEPSEEK_DSML_V3_2: deepseek_dsml.make_parser,
    ToolSyntax.KIMI_K2: kimi_k2.make_parser,
}
# the parsers told whether a grammar padded the values (make_output_parser's ``padded``)
_PADDED_PARSERS = {
    ToolSyntax.GLM_XML: glm_xml.make_parser,
    ToolSyntax.MINIMAX_XML: minimax_xml.make_parser,
}


# The spacing around <think> of the templates that use each tool syntax, where it is known
# exactly (the others drop the newlines after the tags, as before).
_THINK_SEPARATORS = {
    ToolSyntax.NONE: think.QWEN,
    ToolSyntax.QWEN3_JSON: think.QWEN,
    ToolSyntax.QWEN3_XML: think.QWEN,
    # MiniMax-M2: '<think>\n' + reasoning + '\n</think>\n\n' + content, as Qwen's
    ToolSyntax.MINIMAX_XML: think.QWEN,
    ToolSyntax.KIMI_K2: think.NONE,
}
# markers of a tool syntax that end an unclosed reasoning block (the model opened its calls
# inside it), where the model is known to do so
_REASONING_ENDS = {ToolSyntax.KIMI_K2: kimi_k2.OPENS}


def make_output_parser(
    syntax: OutputSyntax,
    tools: ToolSchemas,
    start_in_reasoning: bool = False,
    parse_tools: bool = True,
    reasoning: bool = True,
    opened: str = "",
    padded: bool = False,
) -> OutputParser:
    """A fresh incremental parser for one generation (``parse_tools=False``: tool_choice
    none, any tool-call markup stays content; ``reasoning=False``: a grammar holds the output
    from its first token, so none of it is reasoning, whatever the prompt left open, and a
    reasoning tag inside a forced call's arguments is text; ``opened``: what the prompt wrote
    after the ``<think>`` it left open, :func:`prompt_opened`; ``padded``: a forced call's
    grammar wrote the output, whose XML styles may pad each value with one whitespace
    character on each side, which the syntaxes whose templates write no padding strip)."""
    if syntax.tools is ToolSyntax.HARMONY:
        return harmony.make_parser(tools)
    tool_parser: OutputParser = PassThrough()
    if parse_tools and syntax.tools in _PADDED_PARSERS:
        tool_parser = _PADDED_PARSERS[syntax.tools](tools, padded)
    elif parse_tools and syntax.tools in _TOOL_PARSERS:
        tool_parser = _TOOL_PARSERS[syntax.tools](tools)
    if not reasoning:
        return Chain(PassThrough(), tool_parser)
    if syntax.reasoning is ReasoningSyntax.THINK:
        seps = _THINK_SEPARATORS.get(syntax.tools, think.LOOSE)
        ends = _REASONING_ENDS.get(syntax.tools, ()) if parse_tools else ()
        reasoner = ThinkParser(start_in_reasoning, separators=seps, opened=opened, ends=ends)
        return Chain(reasoner, tool_parser)
    if syntax.reasoning is ReasoningSyntax.GEMMA4_THOUGHT:
        thought = ThinkParser(
            start_in_reasoning,
            gemma4.THOUGHT_OPEN,
            gemma4.THOUGHT_CLOSE,
            separators=gemma4.THOUGHT_SEPARATORS,
        )
        return Chain(thought, tool_parser)
    return Chain(PassThrough(), tool_parser)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt leaves a ``<think>`` block open (the template already
    started the model's reasoning)."""
    return prompt_text.rfind("<think>") > prompt_text.rfind("</think>")


def prompt_opened(prompt_text: str) -> str:
    """What the prompt wrote after the ``<think>`` it leaves open (Qwen3.5: ``"\n"``)."""
    return prompt_text[prompt_text.rfind("<think>") + len("<think>") :]
