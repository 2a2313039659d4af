"""What a client sends back renders to what the model generated (issue 46).

Coding agents send the assistant message back as they received it: reasoning, content and tool
calls. The chat template renders it into the next prompt, and every token that renders
differently from the generated one forces a re-prefill from there. So the output parser must
return reasoning and content without the separators the template itself writes around
``</think>`` and before a call: for each template below, a generated text (the assistant turn as
the template spells it) is parsed, sent back as an OpenAI client sends it, rendered again, and
must give the same prompt text, token for token.

The same for the other tool syntaxes (GLM, MiniMax, DSML V3.2 and V4, Gemma-4, Kimi-K2): with
templates of ours written from their formats, always, and with the vendors' own templates from
llama.cpp's tree when FT_LLAMA_CPP_SRC names one (skipped otherwise, with the reason).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from agent_harnesses import QWEN3_TEMPLATE

from freetokend.engine.chat_template import ChatTemplate, ChatTemplateError
from freetokend.models.builtin import CHAT_TEMPLATE
from freetokend.models.builtin_tokenizer import build_tokenizer
from freetokend.server.parsers.base import Content, Reasoning, ToolCall, merge
from freetokend.server.parsers.registry import (
    ToolSyntax,
    detect_syntax,
    make_output_parser,
    prompt_opened,
    prompt_opens_reasoning,
)
from freetokend.server.routes.openai_chat import convert_message
from freetokend.server.schemas.openai import ChatMessage

# Qwen3.5's chat template as far as these tests need it, written from its documented behaviour:
# the generation prompt opens the think block ('<think>\n'); an assistant turn after the last
# user query is '<think>\n' + reasoning|trim + '\n</think>\n\n' + content|trim; its calls are
# XML, '\n\n' before the first when there is content, '\n' between two; each value is a line of
# its own ('<parameter=K>\n' + value + '\n</parameter>\n'), strings as they are, others as JSON.
QWEN35_TEMPLATE = """\
{%- if tools -%}
{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\nCall a function as <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\n' -}}
{{- 'VALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- set content = (m.content if m.content is string else '') | trim -%}
{%- if m.role == 'user' -%}
{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' -}}
{%- elif m.role == 'assistant' -%}
{%- set reasoning = (m.reasoning_content if m.reasoning_content is string else '') | trim -%}
{%- if loop.index0 > ns.last_query -%}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content -}}
{%- else -%}
{{- '<|im_start|>assistant\\n' + content -}}
{%- endif -%}
{%- for call in m.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first -%}{{- '\\n' -}}{%- elif content -%}{{- '\\n\\n' -}}{%- endif -%}
{{- '<tool_call>\\n<function=' + fn.name + '>\\n' -}}
{%- for key, value in fn.arguments | items -%}
{{- '<parameter=' + key + '>\\n' -}}
{{- value if value is string else value | tojson -}}
{{- '\\n</parameter>\\n' -}}
{%- endfor -%}
{{- '</function>\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}
"""

TEMPLATES = {"builtin": CHAT_TEMPLATE, "qwen3": QWEN3_TEMPLATE, "qwen3.5": QWEN35_TEMPLATE}
SYNTAX = {"builtin": ToolSyntax.QWEN3_JSON, "qwen3": ToolSyntax.QWEN3_JSON}

PARAMS = {
    "read": {"path": {"type": "string"}, "limit": {"type": "integer"}},
    "bash": {"command": {"type": "string"}},
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
        },
    }
    for name, props in PARAMS.items()
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

READ: dict[str, Any] = {"name": "read", "arguments": {"path": "src/app.py", "limit": 40}}
BASH: dict[str, Any] = {"name": "bash", "arguments": {"command": "pytest -q tests/\nls -la"}}
REASONING = "The bug is in app.py.\n\nI should read it first, then run the tests."
# (reasoning, content, calls): the assistant turns the template spells out
SHAPES: dict[str, tuple[str | None, str, list[dict[str, Any]]]] = {
    "reasoning then answer": (REASONING, "Fixed: the tests pass.", []),
    "reasoning only": (REASONING, "", []),
    "answer only": (None, "Done.\n\n- one\n- two", []),
    "content then call": (None, "Reading the file.", [READ]),
    "call only": (None, "", [READ]),
    "reasoning then call": (REASONING, "", [READ]),
    "two calls": (None, "", [BASH, READ]),
    "reasoning, content, two calls": (REASONING, "Running the tests:", [BASH, READ]),
}

CONVERSATION = [{"role": "user", "content": "Fix the bug in src/app.py"}]


def wire_call(i: int, call: dict[str, Any]) -> dict[str, Any]:
    args = json.dumps(call["arguments"], ensure_ascii=False)
    return {
        "id": call.get("id") or f"call_{i}",
        "type": "function",
        "function": {"name": call["name"], "arguments": args},
    }


def client_message(reasoning: str | None, content: str, calls: list[dict[str, Any]]) -> dict:
    """The assistant message as an OpenAI client sends it, as the daemon's request path reads it
    (convert_message): what reaches the template."""
    wire: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        wire["reasoning_content"] = reasoning
    if calls:
        wire["tool_calls"] = [wire_call(i, c) for i, c in enumerate(calls)]
    return convert_message(msgspec.convert(wire, ChatMessage), len(CONVERSATION))


def render(template: ChatTemplate, messages: list[dict[str, Any]], prompt: bool) -> str:
    return template.render(messages, tools=TOOLS, add_generation_prompt=prompt)


def parse(name: str, prompt: str, generated: str, pieces: list[str]):
    syntax = detect_syntax("qwen3_5_moe", TEMPLATES[name])
    assert syntax.tools is SYNTAX.get(name, ToolSyntax.QWEN3_XML)
    opens = prompt_opens_reasoning(prompt)
    parser = make_output_parser(
        syntax, SCHEMAS, start_in_reasoning=opens, opened=prompt_opened(prompt) if opens else ""
    )
    events = [ev for piece in pieces for ev in parser.feed(piece)]
    events = merge(events + parser.finish())
    assert "".join(pieces) == generated
    return events


def sent_back(events) -> dict[str, Any]:
    """What an OpenAI client receives (openai_chat_out) and sends back unchanged."""
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning)) or None
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = [
        {"name": e.name, "arguments": json.loads(e.arguments), "id": e.id}
        for e in events
        if isinstance(e, ToolCall)
    ]
    return client_message(reasoning, content, calls)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", TEMPLATES)
def test_what_a_client_sends_back_renders_to_the_generated_text(name: str, shape: str) -> None:
    template = ChatTemplate({"default": TEMPLATES[name]})
    tokenizer = build_tokenizer()
    reasoning, content, calls = SHAPES[shape]
    prompt = render(template, CONVERSATION, prompt=True)
    turn = render(template, [*CONVERSATION, client_message(reasoning, content, calls)], False)
    # the generated text: the assistant turn as the template spells it, after what the
    # generation prompt already wrote, up to the end-of-turn token
    assert turn.startswith(prompt) and turn.endswith("<|im_end|>\n"), turn
    generated = turn[len(prompt) : -len("<|im_end|>\n")]

    # streamed in one piece, token by token and character by character
    ids = tokenizer.encode(generated, add_special_tokens=False).ids
    by_token = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert "".join(by_token) == generated
    outcomes = [parse(name, prompt, generated, p) for p in ([generated], by_token, [*generated])]
    assert outcomes[1] == outcomes[0] and outcomes[2] == outcomes[0]
    events = outcomes[0]
    assert [e.name for e in events if isinstance(e, ToolCall)] == [c["name"] for c in calls]

    again = render(template, [*CONVERSATION, sent_back(events)], False)
    assert again == turn
    # the assistant part, token for token (the whole prompt is re-tokenized as one text: where
    # the generation prompt ends in a newline and the reply starts with one, as an empty Qwen3.5
    # reasoning block does, the two may merge; that is the template's, not the parser's)
    assert again.startswith(prompt)
    end = tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.encode(again[len(prompt) :], add_special_tokens=False).ids == [*ids, end, 10]


def test_the_separators_and_nothing_else() -> None:
    """The built-in model's spacing, spelled out: the newline after <think> and before
    </think>, the blank line after it, the newline before a call and between two calls are the
    template's; any other newline is the model's and stays."""
    text = (
        '<think>\n\nplan\n\n</think>\n\n\nSure.\n\n<tool_call>\n{"name": "bash", "arguments": '
        '{"command": "ls"}}\n</tool_call>\n<tool_call>\n{"name": "bash", "arguments": {}}\n'
        "</tool_call>"
    )
    events = parse("builtin", "<|im_start|>assistant\n", text, [text])
    assert events == [
        Reasoning("\nplan\n"),
        Content("\nSure.\n"),
        ToolCall(0, "bash", '{"command": "ls"}'),
        ToolCall(1, "bash", "{}"),
    ]
    template = ChatTemplate({"default": CHAT_TEMPLATE})
    again = render(template, [*CONVERSATION, sent_back(events)], False)
    assert again.endswith("<|im_start|>assistant\n" + text + "<|im_end|>\n")


def test_held_separators_reach_the_client_when_no_call_follows() -> None:
    """A newline that might be a call's separator is held back while streaming, and given out
    when the text ends without a call; cut inside the tag after it, it is still a call."""
    syntax = detect_syntax("qwen3_5_moe", CHAT_TEMPLATE)
    for text, truncated, want in [
        ("Sure.\n", False, [Content("Sure.\n")]),
        ("Sure.\n\n", True, [Content("Sure.\n\n")]),
        ("Sure.\n<tool_", True, [Content("Sure."), ToolCall(0, "read", "{}", partial=True)]),
    ]:
        parser = make_output_parser(syntax, {"read": SCHEMAS["read"]})
        events = [ev for ch in text for ev in parser.feed(ch)]
        assert merge(events + parser.finish(truncated)) == want, text


# --- the other tool syntaxes ------------------------------------------------------------------
#
# The vendors' own templates, as llama.cpp's tree carries them (models/templates), are read at
# test time from FT_LLAMA_CPP_SRC (an unpacked vendor/llama.cpp, as tests/bench uses): they are
# the model vendors' files and are not copied here. The templates below are ours, written from
# the formats (each spells an assistant turn as the vendor's does, for user and assistant
# messages only), and always run.

# Kimi-K2-Thinking: '<think>' + reasoning + '</think>' + content + the call section, each call's
# id written back as the client sent it (K2-Instruct writes it into the tool result)
KIMI_TEMPLATE = """\
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'assistant' -%}
<|im_assistant|>assistant<|im_middle|><think>{{ m.reasoning_content or '' }}</think>
{{- m.content or '' -}}
{%- if m.tool_calls -%}<|tool_calls_section_begin|>
{%- for c in m.tool_calls -%}
<|tool_call_begin|>{{ c.id }}<|tool_call_argument_begin|>{{ c.function.arguments | tojson }}
{{- '<|tool_call_end|>' -}}
{%- endfor -%}<|tool_calls_section_end|>
{%- endif -%}<|im_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""

# how the XML-ish syntaxes write a value: strings as they are, the rest as JSON
_VALUE = "{{- v if v is string else v | tojson -}}"

# GLM-4.6: '\n<think>' + reasoning + '</think>' + '\n' + content (both trimmed), '\n' + each
# call, a line per tag
GLM_TEMPLATE = """\
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- '<|user|>\\n' + m.content -}}
{%- elif m.role == 'assistant' -%}
{{- '<|assistant|>\\n<think>' + (m.reasoning_content or '') | trim + '</think>' -}}
{{- '\\n' + (m.content or '') | trim -}}
{%- for c in m.tool_calls or [] -%}
{{- '\\n<tool_call>' + c.function.name -}}
{%- for k, v in c.function.arguments | items -%}
{{- '\\n<arg_key>' + k + '</arg_key>\\n<arg_value>' -}}VALUE{{- '</arg_value>' -}}
{%- endfor -%}
{{- '\\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}
""".replace("VALUE", _VALUE)

# MiniMax-M2: the prompt opens '<think>\n'; '<think>\n' + reasoning + '\n</think>\n\n' (when
# there is reasoning) + content + '\n' + one block of invocations + '[e~[\n'
MINIMAX_TEMPLATE = """\
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- ']~b]user\\n' + m.content + '[e~[\\n' -}}
{%- elif m.role == 'assistant' -%}
{{- ']~b]ai\\n' -}}
{%- if m.reasoning_content -%}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}{%- endif -%}
{{- m.content or '' -}}
{%- if m.tool_calls -%}
{{- '\\n<minimax:tool_call>\\n' -}}
{%- for c in m.tool_calls -%}
{{- '<invoke name="' + c.function.name + '">\\n' -}}
{%- for k, v in c.function.arguments | items -%}
{{- '<parameter name="' + k + '">' -}}VALUE{{- '</parameter>\\n' -}}
{%- endfor -%}
{{- '</invoke>\\n' -}}
{%- endfor -%}
{{- '</minimax:tool_call>' -}}
{%- endif -%}
{{- '[e~[\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ']~b]ai\\n<think>\\n' -}}{%- endif -%}
""".replace("VALUE", _VALUE)

# DeepSeek-V3.2 (thinking) and V4 (not thinking): '<think>' + reasoning + '</think>' (V4 without
# thinking: '</think>' alone) + content + '\n\n' + the DSML block + '<｜end▁of▁sentence｜>'
DSML_TEMPLATE = """\
{%- set dsml = '｜DSML｜' -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- '<｜User｜>' + m.content + '<｜Assistant｜>' -}}
{%- elif m.role == 'assistant' -%}
{%- if THINKING -%}{{- '<think>' + (m.reasoning_content or '') -}}{%- endif -%}
{{- '</think>' + (m.content or '') -}}
{%- if m.tool_calls -%}
{{- '\\n\\n<' + dsml + 'BLOCK>\\n' -}}
{%- for c in m.tool_calls -%}
{{- '<' + dsml + 'invoke name="' + c.function.name + '">\\n' -}}
{%- for k, v in c.function.arguments | items -%}
{{- '<' + dsml + 'parameter name="' + k + '" string="' -}}
{{- ('true' if v is string else 'false') + '">' -}}VALUE{{- '</' + dsml + 'parameter>\\n' -}}
{%- endfor -%}
{{- '</' + dsml + 'invoke>\\n' -}}
{%- endfor -%}
{{- '</' + dsml + 'BLOCK>' -}}
{%- endif -%}
{{- '<｜end▁of▁sentence｜>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<think>' if THINKING else '</think>' -}}{%- endif -%}
""".replace("VALUE", _VALUE)
DSML_V3_2_TEMPLATE = DSML_TEMPLATE.replace("BLOCK", "function_calls").replace("THINKING", "true")
DSML_V4_TEMPLATE = DSML_TEMPLATE.replace("BLOCK", "tool_calls").replace("THINKING", "false")

# Gemma-4 (thinking): the thought channel (only with calls) + the calls + content, then
# '<|tool_response>' after calls, '<turn|>\n' otherwise; arguments in Gemma's notation (keys bare
# and sorted, strings between <|"|>), nested values too
GEMMA_TEMPLATE = """\
{%- macro value(v) -%}
{%- if v is string -%}{{- '<|"|>' + v + '<|"|>' -}}
{%- elif v is mapping -%}{{- '{' -}}
{%- for k, x in v | dictsort -%}{{- k + ':' -}}{{- value(x) -}}{%- if not loop.last -%},{%- endif -%}
{%- endfor -%}{{- '}' -}}
{%- elif v is iterable -%}{{- '[' -}}
{%- for x in v -%}{{- value(x) -}}{%- if not loop.last -%},{%- endif -%}{%- endfor -%}{{- ']' -}}
{%- else -%}{{- v | tojson -}}
{%- endif -%}
{%- endmacro -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- '<|turn>user\\n' + m.content + '<turn|>\\n' -}}
{%- elif m.role == 'assistant' -%}
{{- '<|turn>model\\n' -}}
{%- if m.reasoning_content and m.tool_calls -%}
{{- '<|channel>thought\\n' + m.reasoning_content + '\\n<channel|>' -}}
{%- endif -%}
{%- for c in m.tool_calls or [] -%}
{{- '<|tool_call>call:' + c.function.name + value(c.function.arguments) + '<tool_call|>' -}}
{%- endfor -%}
{{- m.content or '' -}}
{{- '<|tool_response>' if m.tool_calls else '<turn|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}
"""


def llama_cpp_template(name: str) -> str | None:
    """``models/templates/<name>`` of the llama.cpp tree FT_LLAMA_CPP_SRC names, or None."""
    src = os.environ.get("FT_LLAMA_CPP_SRC")
    path = Path(src) / "models" / "templates" / name if src else None
    return path.read_text(encoding="utf-8") if path is not None and path.is_file() else None


NO_REASONING = frozenset(s for s, (reasoning, _, _) in SHAPES.items() if not reasoning)
WITH_CALLS = frozenset(s for s, (_, _, calls) in SHAPES.items() if calls)


@dataclass(frozen=True)
class Case:
    template: str  # a file of llama.cpp's models/templates (*.jinja), or the template itself
    family: str
    tools: ToolSyntax
    ends: tuple[str, ...]  # what the template writes after an assistant turn
    kwargs: dict[str, Any] = field(default_factory=dict)
    # shapes the template renders in history otherwise than its generation prompt begins them
    # (it opens <think> in the prompt but writes no reasoning block when there is none)
    differs: frozenset[str] = frozenset()
    # shapes the template cannot render in the sandbox (transformers' too): Kimi's templates
    # append to a list to number the calls
    refused: frozenset[str] = frozenset()


DSML_END = ("<｜end▁of▁sentence｜>",)
GEMMA_ENDS = ("<turn|>\n", "<|tool_response>")
CASES = {
    "Kimi-K2 (ours)": Case(KIMI_TEMPLATE, "deepseek_v3", ToolSyntax.KIMI_K2, ("<|im_end|>",)),
    "GLM-4.6 (ours)": Case(GLM_TEMPLATE, "glm_moe_dsa", ToolSyntax.GLM_XML, ("",)),
    "MiniMax-M2 (ours)": Case(
        MINIMAX_TEMPLATE, "minimax_m2", ToolSyntax.MINIMAX_XML, ("[e~[\n",), differs=NO_REASONING
    ),
    "DeepSeek-V3.2 (ours)": Case(
        DSML_V3_2_TEMPLATE, "deepseek_v32", ToolSyntax.DEEPSEEK_DSML_V3_2, DSML_END
    ),
    "DeepSeek-V4 (ours)": Case(DSML_V4_TEMPLATE, "deepseek_v4", ToolSyntax.DEEPSEEK_DSML, DSML_END),
    "Gemma-4 (ours)": Case(GEMMA_TEMPLATE, "gemma4", ToolSyntax.GEMMA4, GEMMA_ENDS),
    "Kimi-K2-Thinking": Case(
        "Kimi-K2-Thinking.jinja", "deepseek_v3", ToolSyntax.KIMI_K2, ("<|im_end|>",),
        refused=WITH_CALLS,
    ),
    "Kimi-K2-Instruct": Case(
        "Kimi-K2-Instruct.jinja", "deepseek_v3", ToolSyntax.KIMI_K2, ("<|im_end|>",),
        refused=WITH_CALLS,
    ),
    "GLM-4.6": Case("GLM-4.6.jinja", "glm4_moe", ToolSyntax.GLM_XML, ("",)),
    "GLM-4.7-Flash": Case(
        "GLM-4.7-Flash.jinja", "glm4_moe_lite", ToolSyntax.GLM_XML, ("",), differs=NO_REASONING
    ),
    "MiniMax-M2": Case(
        "MiniMax-M2.jinja", "minimax_m2", ToolSyntax.MINIMAX_XML, ("[e~[\n",),
        differs=NO_REASONING,
    ),
    "DeepSeek-V3.2 thinking": Case(
        "deepseek-ai-DeepSeek-V3.2.jinja", "deepseek_v32", ToolSyntax.DEEPSEEK_DSML_V3_2,
        DSML_END, {"thinking": True},
    ),
    "DeepSeek-V4 thinking": Case(
        "deepseek-ai-DeepSeek-V4.jinja", "deepseek_v4", ToolSyntax.DEEPSEEK_DSML, DSML_END,
        {"thinking": True},
    ),
    "DeepSeek-V4": Case(
        "deepseek-ai-DeepSeek-V4.jinja", "deepseek_v4", ToolSyntax.DEEPSEEK_DSML, DSML_END,
        {"thinking": False},
    ),
    "Gemma-4 thinking": Case(
        "google-gemma-4-31B-it.jinja", "gemma4", ToolSyntax.GEMMA4, GEMMA_ENDS,
        {"enable_thinking": True},
    ),
}  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", CASES)
def test_other_syntaxes_render_back_to_the_generated_text(case: str, shape: str) -> None:
    """As above, for GLM, MiniMax, DSML (V3.2 and V4), Gemma-4 and Kimi: the assistant turn the
    template writes is parsed (at once and char by char), sent back as a client sends it (Kimi's
    call ids included) and renders to the same text."""
    c = CASES[case]
    vendor = c.template.endswith(".jinja")
    source = llama_cpp_template(c.template) if vendor else c.template
    if source is None:
        pytest.skip(
            f"{c.template} is read from llama.cpp's models/templates: set FT_LLAMA_CPP_SRC to an "
            "unpacked vendor/llama.cpp (the vendors' templates are not copied into the tests)"
        )
    template = ChatTemplate({"default": source})
    reasoning, content, calls = SHAPES[shape]
    if c.tools is ToolSyntax.KIMI_K2:  # Kimi's ids, as the model writes them
        calls = [{**call, "id": f"functions.{call['name']}:{i}"} for i, call in enumerate(calls)]
    message = client_message(reasoning, content, calls)

    def render(messages: list[dict[str, Any]], prompt: bool) -> str:
        return template.render(messages, tools=TOOLS, add_generation_prompt=prompt, **c.kwargs)

    prompt = render(CONVERSATION, True)
    if shape in c.refused:
        with pytest.raises(ChatTemplateError, match="unsafe"):
            render([*CONVERSATION, message], False)
        pytest.skip(f"{c.template} appends to a list, which the template sandbox refuses")
    turn = render([*CONVERSATION, message], False)
    if shape in c.differs:
        assert not turn.startswith(prompt)
        pytest.skip(f"{case} writes no reasoning block in history where its prompt opens one")
    assert turn.startswith(prompt), (prompt[-80:], turn[len(prompt) - 80 :])
    generated = turn[len(prompt) :]
    end = next((e for e in c.ends if generated.endswith(e)), None)
    assert end is not None, generated[-80:]
    generated = generated[: len(generated) - len(end)]

    syntax = detect_syntax(c.family, source)
    assert syntax.tools is c.tools
    opens = prompt_opens_reasoning(prompt)
    outcomes = []
    for pieces in ([generated], [*generated]):
        parser = make_output_parser(
            syntax, SCHEMAS, start_in_reasoning=opens, opened=prompt_opened(prompt) if opens else ""
        )
        outcomes.append(merge([ev for p in pieces for ev in parser.feed(p)] + parser.finish()))
    assert outcomes[1] == outcomes[0]
    events = outcomes[0]
    assert [e.name for e in events if isinstance(e, ToolCall)] == [x["name"] for x in calls]
    assert render([*CONVERSATION, sent_back(events)], False) == turn
