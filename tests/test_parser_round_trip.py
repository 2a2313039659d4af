"""What a client sends back renders to what the model generated (issue 46).

Coding agents send the assistant message back as they received it: reasoning, content and tool
calls. The chat template renders it into the next prompt, and every token that renders
differently from the generated one forces a re-prefill from there. So the output parser must
return reasoning and content without the separators the template itself writes around
``</think>`` and before a call: for each template below, a generated text (the assistant turn as
the template spells it) is parsed, sent back as an OpenAI client sends it, rendered again, and
must give the same prompt text, token for token.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from agent_harnesses import QWEN3_TEMPLATE

from freetokend.engine.chat_template import ChatTemplate
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
        "id": f"call_{i}",
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
        {"name": e.name, "arguments": json.loads(e.arguments)}
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
