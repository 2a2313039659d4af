"""Kimi-K2.x output parsing (issue 43 item 3): its tool-call section and ``<think>`` reasoning on
realistic output, streamed split at every character, token by token with Kimi's own tokenizer
(a synthetic rank file in Kimi's layout), and cut by the token limit anywhere; the call ids
(``functions.NAME:IDX``) reaching the OpenAI, Responses and Anthropic shapes; the syntax picked
from Kimi's templates for its checkpoints (``DeepseekV3ForCausalLM``); the anchors; the forced
call's grammar.

The format is learned from llama.cpp's Kimi-K2 parser and templates (``common/parsers/kimi-k2.cpp``,
``models/templates/Kimi-K2-*.jinja``); the slips it tolerates (calls inside an unclosed think
block, calls without their section or closing marker) are tolerated here too.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from test_parser_hard_values import by_token
from test_parser_round_trip import llama_cpp_template
from test_parsers_deepseek_dsml import TOOLS  # get_weather, write_file, update_config
from test_server_parsers import grammars  # noqa: F401

from freetokend.engine.tokenizer import Tokenizer
from freetokend.models.families.kimi_markup import KIMI_ANCHORS, KIMI_TOOL_SYNTAX
from freetokend.models.registry import family_spec
from freetokend.server.parsers.base import (
    Content,
    ParsedEvent,
    Reasoning,
    ToolCall,
    arguments_object,
    merge,
)
from freetokend.server.parsers.kimi_k2 import TAGS
from freetokend.server.parsers.registry import (
    OutputSyntax,
    ReasoningSyntax,
    ToolSyntax,
    detect_syntax,
    make_output_parser,
    parser_markers,
)
from freetokend.server.routes.anthropic_out import tool_use_block
from freetokend.server.routes.openai_chat_out import ChatOutput
from freetokend.server.routes.responses_out import ResponsesOutput
from freetokend.server.service import parser_token_ids, special_tokens_skipped

KIMI = OutputSyntax(ToolSyntax.KIMI_K2, ReasoningSyntax.THINK)
KIMI_INSTRUCT = OutputSyntax(ToolSyntax.KIMI_K2, ReasoningSyntax.NONE)
S, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
B, A, E = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

# a coding agent writing this very parser: every marker inside a string, quotes and braces too
CODE = (
    'SECTION = "<|tool_calls_section_begin|>"\n'
    f'print("{B}functions.x:0{A}{{}}{E}{SE}")\n'
    'print("</think>", "\\"}", {"a": [1, 2]})\n'
)
CONFIG = {"server": {"port": 8080, "hosts": ["a", "b"], "tls": None}, "debug": False, "n": 1.5}


def _args(**kw) -> str:
    return json.dumps(kw, ensure_ascii=False)


def call(name: str, idx: int, **kw) -> str:
    """One call as Kimi writes it (the template's ``tojson``: ASCII kept, spaces after , and :)."""
    return f"{B}functions.{name}:{idx}{A}{json.dumps(kw, ensure_ascii=False)}{E}"


CALLS = [
    ToolCall(0, "get_weather", _args(city="Zürich", days=3), id="functions.get_weather:0"),
    ToolCall(1, "write_file", _args(path="src/kimi.py", content=CODE), id="functions.write_file:1"),
    ToolCall(2, "update_config", _args(config=CONFIG), id="functions.update_config:2"),
]
SECTION = (
    S
    + call("get_weather", 0, city="Zürich", days=3)
    + call("write_file", 1, path="src/kimi.py", content=CODE)
    + call("update_config", 2, config=CONFIG)
    + SE
)
# K2-Thinking: reasoning, text, then one section of three calls (the template writes no spaces)
THINKING_TEXT = (
    "<think>The user wants the weather, a file and a config change.\n\nThree calls.</think>"
    "I'll check the weather, write the file and update the config." + SECTION
)
THINKING_EVENTS = [
    Reasoning("The user wants the weather, a file and a config change.\n\nThree calls."),
    Content("I'll check the weather, write the file and update the config."),
    *CALLS,
]


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory):
    """Kimi's tokenizer from a synthetic rank file in Kimi's layout (its special tokens, the
    tool-call markers among them, at Kimi's ids)."""
    pytest.importorskip("tiktoken")
    from test_tiktoken_vocab import kimi_config, synthetic_ranks, write_rank_file

    from freetokend.engine.tiktoken_vocab import tokenizer_from_tiktoken

    d = tmp_path_factory.mktemp("kimi")
    ranks = synthetic_ranks()
    write_rank_file(d / "tiktoken.model", ranks)
    (d / "tokenizer_config.json").write_text(json.dumps(kimi_config(len(ranks))))
    return tokenizer_from_tiktoken(d)


def _feed(syntax, pieces, opens: bool = False, truncated: bool = False, tools=TOOLS):
    parser = make_output_parser(syntax, tools, start_in_reasoning=opens)
    events: list[ParsedEvent] = []
    for p in pieces:
        events += parser.feed(p)
    return merge(events + parser.finish(truncated=truncated))


def _check(syntax, text: str, expected, tok=None, opens: bool = False) -> None:
    """At once, char by char, token by token, and cut in two at every position."""
    splits = [[text], list(text)] + ([by_token(tok, text)] if tok is not None else [])
    for pieces in splits:
        assert _feed(syntax, pieces, opens) == expected, pieces
    for i in range(1, len(text)):
        assert _feed(syntax, [text[:i], text[i:]], opens) == expected, i


def test_thinking_text_and_three_calls_in_one_section(kimi_tokenizer):
    _check(KIMI, THINKING_TEXT, THINKING_EVENTS, kimi_tokenizer)


def test_instruct_text_calls_and_a_second_section(kimi_tokenizer):
    """K2-Instruct (no thinking): text, a section, more text, another section; the ids are
    the model's (numbered per message by K2-Instruct's template)."""
    text = (
        "Checking.\n"
        + S
        + call("get_weather", 0, city="Oslo")
        + SE
        + "\nAnd the file:"
        + S
        + call("write_file", 1, path="a.md", content="# Title\n\n- one")
        + SE
    )
    expected = [
        Content("Checking.\n"),
        ToolCall(0, "get_weather", _args(city="Oslo"), id="functions.get_weather:0"),
        Content("\nAnd the file:"),
        ToolCall(1, "write_file", _args(path="a.md", content="# Title\n\n- one"), id=CALLS[1].id),
    ]
    _check(KIMI_INSTRUCT, text, expected, kimi_tokenizer)


def test_calls_opened_inside_the_reasoning_and_without_markers():
    """llama.cpp's cases: the section opened before </think> (the reasoning ends there), and
    calls without their section or closing markers (the next call or the end ends one)."""
    inside = "<think>I need two calls" + SECTION
    _check(KIMI, inside, [Reasoning("I need two calls"), *CALLS])
    bare = (
        "<think>I need two calls"
        f'{B}functions.get_weather:0{A}{{"city": "Zürich", "days": 3}}'
        f"{B}functions.write_file:1{A}{json.dumps({'path': 'src/kimi.py', 'content': CODE})}"
    )
    _check(KIMI, bare, [Reasoning("I need two calls"), *CALLS[:2]])
    # markers written twice
    doubled = S + S + call("get_weather", 0, city="Zürich", days=3) + E + "\n" + SE + "Done."
    _check(KIMI, doubled, [CALLS[0], Content("Done.")])
    # the reasoning opened by the prompt, a call after whitespace, the section never closed
    loose = f"plan</think>Ok.{S}\n{call('get_weather', 0, city='Zürich', days=3)}\n"
    _check(KIMI, loose, [Reasoning("plan"), Content("Ok."), CALLS[0]], opens=True)


def test_the_id_is_kept_unless_it_repeats_or_has_another_form():
    text = (
        S
        + call("get_weather", 4, city="Zürich", days=3)
        + call("get_weather", 4, city="Zürich", days=3)  # the same id again
        + f"{B}get_weather{A}{{}}{E}"  # no id form: the name alone
        + SE
    )
    args = _args(city="Zürich", days=3)
    assert _feed(KIMI, [text]) == [
        ToolCall(0, "get_weather", args, id="functions.get_weather:4"),
        ToolCall(1, "get_weather", args),
        ToolCall(2, "get_weather", "{}"),
    ]


def test_what_does_not_decode_is_given_back():
    not_json = f"{S}{B}functions.get_weather:0{A}{{city: Oslo}}{E}{SE}"
    assert _feed(KIMI, [not_json]) == [Content(not_json[: -len(SE)])]
    not_an_object = f"{S}{B}functions.get_weather:0{A}[1]{E}"
    assert _feed(KIMI, [not_an_object]) == [Content(not_an_object)]
    bad_head = f"{S}{B}functions.get weather now{A}{{}}{E}"
    assert _feed(KIMI, [bad_head]) == [Content(bad_head)]
    no_args = f"{S}{B}functions.get_weather:0{B}functions.get_weather:1{A}{{}}{E}{SE}"
    assert _feed(KIMI, [no_args]) == [
        Content(f"{S}{B}functions.get_weather:0"),
        ToolCall(0, "get_weather", "{}", id="functions.get_weather:1"),
    ]
    endless = f"{S}{B}functions.{'x' * 600}"
    assert _feed(KIMI, [endless]) == [Content(endless)]
    # text after a call inside the section: the section ended there
    text = f"{S}{call('get_weather', 0, city='Zürich', days=3)}Done, thanks."
    assert _feed(KIMI, [text]) == [CALLS[0], Content("Done, thanks.")]
    # markers spelled in plain text that open nothing stay text
    prose = "The tags look like <|tool_call, <|tool_calls_section and <think and end here."
    _check(KIMI_INSTRUCT, prose, [Content(prose)])
    # an unclosed string swallows the closing marker while streaming; at the end the call ends
    # at the first marker, as with no quoting: not JSON, all of it text again
    broken = f'{S}{B}functions.get_weather:0{A}{{"city": "Oslo}}{E}after'
    assert _feed(KIMI, list(broken)) == [Content(broken)]
    unclosed = f'{S}{B}functions.get_weather:0{A}{{"city": "Oslo"}}{E}{B}functions.x:1{A}{{"a": "'
    assert _feed(KIMI, [unclosed + "b}"]) == [
        ToolCall(0, "get_weather", _args(city="Oslo"), id="functions.get_weather:0"),
        Content(f'{B}functions.x:1{A}{{"a": "b}}'),
    ]


def test_a_call_cut_by_the_token_limit_is_a_partial_call():
    one = {"get_weather": TOOLS["get_weather"]}
    text = S + call("get_weather", 0, city="Zürich", days=3) + SE
    for i in range(1, len(text)):
        for tools in (one, TOOLS):
            events = _feed(KIMI_INSTRUCT, [text[:i]], truncated=True, tools=tools)
            assert not [e for e in events if isinstance(e, Content)], (i, events)
            if not events:  # cut before the name, with several tools: nothing to report
                assert tools is TOOLS, i
                continue
            (cut,) = events
            assert isinstance(cut, ToolCall) and cut.name == "get_weather", (i, cut)
            assert cut.partial == (i < len(text) - len(SE)), (i, cut)
            for key, value in arguments_object(cut.arguments).items():  # as far as written
                want = {"city": "Zürich", "days": 3}[key]
                assert value == want or want.startswith(value), (i, cut)
    # cut inside a string holding a marker: the marker is text
    value = f"x {E} y"
    cut = S + call("get_weather", 0, city=value)[: -len('"}') - len(E) - 1]
    (partial,) = _feed(KIMI, [cut], truncated=True)
    assert partial.partial and partial.id == "functions.get_weather:0"
    assert arguments_object(partial.arguments) == {"city": value[:-1]}


def test_ids_reach_every_api_shape():
    """The id the model wrote is the call's id in the OpenAI chat, Responses and Anthropic
    shapes (a client sends it back as the tool result's id, which K2-Instruct's template
    writes); a call without one gets a fresh id."""
    kimi, other = CALLS[0], ToolCall(0, "get_weather", "{}")
    chat = ChatOutput(SimpleNamespace(), "m", include_usage=False)
    assert chat._call(kimi)["id"] == "functions.get_weather:0"
    assert chat._call(other)["id"].startswith("call_")
    assert ResponsesOutput._call_item(kimi)["call_id"] == "functions.get_weather:0"
    assert ResponsesOutput._call_item(other)["call_id"].startswith("call_")
    assert tool_use_block(kimi)["id"] == "functions.get_weather:0"
    assert tool_use_block(kimi)["input"] == {"city": "Zürich", "days": 3}
    assert tool_use_block(other)["id"].startswith("toolu_")


# --- the syntax per checkpoint, the anchors --------------------------------------------------

# Kimi's templates as far as the syntax detection reads them (the markers they spell)
THINKING_TEMPLATE = (
    "{%- for m in messages -%}<|im_assistant|>assistant<|im_middle|><think>{{ m.reasoning_content }}"
    "</think>{{ m.content }}<|tool_calls_section_begin|><|tool_call_begin|>functions.{{ m.name }}:0"
    "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    "{%- endfor -%}"
)
INSTRUCT_TEMPLATE = THINKING_TEMPLATE.replace("<think>{{ m.reasoning_content }}</think>", "")


def test_kimi_checkpoints_pick_kimi_syntax_from_their_templates():
    """Kimi-K2 is DeepseekV3ForCausalLM with Kimi's tokenizer: its template decides (thinking
    where the template has <think>); DeepSeek-V3's own template gets no tool syntax."""
    assert family_spec("deepseek_v3").tool_syntax == "none"
    assert detect_syntax("deepseek_v3", THINKING_TEMPLATE) == KIMI
    assert detect_syntax("deepseek_v3", INSTRUCT_TEMPLATE) == KIMI_INSTRUCT
    assert detect_syntax("deepseek_v3", "{{ '<｜Assistant｜>' }}").tools is ToolSyntax.NONE
    assert ToolSyntax(KIMI_TOOL_SYNTAX) is ToolSyntax.KIMI_K2
    for name, want in (
        ("Kimi-K2-Thinking.jinja", KIMI),
        ("Kimi-K2-Instruct.jinja", KIMI_INSTRUCT),
        ("moonshotai-Kimi-K2.jinja", KIMI_INSTRUCT),
    ):
        source = llama_cpp_template(name)
        if source is not None:  # the vendors' own templates, where llama.cpp's tree is here
            assert detect_syntax("deepseek_v3", source) == want, name


def test_anchors_are_kimi_markers_and_resolve_in_kimi_tokenizer(kimi_tokenizer):
    """The family's anchors are Kimi's markers, each one special token of Kimi's tokenizer (as
    LLM._anchor_ids resolves them); the parser reads every tool-call marker."""
    assert family_spec("deepseek_v3").anchors == KIMI_ANCHORS
    for text, _ in KIMI_ANCHORS:
        assert kimi_tokenizer.token_to_id(text) is not None, text
    kinds = dict(KIMI_ANCHORS)
    assert kinds["<|tool_calls_section_begin|>"] == "tool_call_start"
    assert kinds["<|im_end|>"] == "end_of_turn" and kinds["</think>"] == "end_of_thinking"
    assert set(TAGS) | {"<think>", "</think>"} == set(parser_markers(KIMI))
    for tag in TAGS:
        assert kimi_tokenizer.encode(tag, add_special_tokens=False).ids == [
            kimi_tokenizer.token_to_id(tag)
        ]
    # the markers are special tokens of Kimi's tokenizer: written out for the parser anyway
    tok = Tokenizer(kimi_tokenizer)
    kept = parser_token_ids(tok, KIMI)
    assert {tok.token_to_id(t) for t in (*TAGS, "<think>", "</think>")} == kept
    assert kept <= tok.special_token_ids
    assert special_tokens_skipped(KIMI, False, kept) == (True, kept)


# --- the forced call's grammar ---------------------------------------------------------------


def test_forced_call_grammar_writes_a_kimi_call_with_its_index(grammars):  # noqa: F811
    factory = grammars[0]
    schema = TOOLS["get_weather"]

    def accepts(text: str) -> bool:
        c = factory.forced_tool_call(ToolSyntax.KIMI_K2, [("get_weather", schema)])
        return bool(c._matcher.accept_string(text))

    head = f"{S}{B}functions.get_weather:"
    args = f'{A}{{"city": "Oslo", "days": 2}}{E}{SE}'
    for idx in ("0", "7", "12", "9999"):
        assert accepts(head + idx + args), idx
    for idx in ("", "01", "12345", "x"):
        assert not accepts(head + idx + args), idx
    assert not accepts(f"{S}{B}functions.read:0{args}")
    assert _feed(KIMI, [head + "12" + args]) == [
        ToolCall(0, "get_weather", _args(city="Oslo", days=2), id="functions.get_weather:12")
    ]
