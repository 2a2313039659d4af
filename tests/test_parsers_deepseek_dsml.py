"""DeepSeek-V4 / DeepSeek-V3.2 "DSML" tool calls and <think> reasoning on realistic output:
streamed in every split and token by token, cut by the token limit anywhere, broken blocks,
detection from the templates, and the forced-call grammar."""

from __future__ import annotations

import json
import re

import pytest
from test_server_parsers import SCHEMA, check_all_splits, grammars, run, sample_under  # noqa: F401

from freetokend.models.families.deepseek_markup import DEEPSEEK_DSML_ANCHORS
from freetokend.server.parsers.base import (
    Content,
    ParsedEvent,
    Reasoning,
    ToolCall,
    arguments_object,
    merge,
)
from freetokend.server.parsers.registry import (
    OutputSyntax,
    ReasoningSyntax,
    ToolSyntax,
    detect_syntax,
    make_output_parser,
    prompt_opens_reasoning,
)

D = "｜DSML｜"  # U+FF5C fullwidth bars: one token of DeepSeek's tokenizer
V4 = OutputSyntax(ToolSyntax.DEEPSEEK_DSML, ReasoningSyntax.THINK)
V3_2 = OutputSyntax(ToolSyntax.DEEPSEEK_DSML_V3_2, ReasoningSyntax.THINK)

TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
    "write_file": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    },
    "update_config": {
        "type": "object",
        "properties": {"config": {"type": "object"}, "dry_run": {"type": "boolean"}},
    },
}

# multi-line code with quotes, backslashes, unicode, HTML and the markup's own tags (all but
# the parameter's closing tag, which a raw value cannot hold), ending in a newline that stays
CODE = (
    "def greet(name: str) -> str:\n"
    '    """Say "hi" \u2014 from Z\u00fcrich \U0001f3d4."""\n'
    '    return f"<b>{name}</b>\\n"\n'
    "\n"
    f'# DSML looks like <{D}invoke name="x"> ... </{D}invoke></{D}tool_calls>\n'
)
CONFIG = {
    "server": {"port": 8080, "ratio": -0.25, "hosts": ["a", "b"], "tls": None},
    "debug": False,
    "verbose": True,
    "empty": {},
    "none": [],
    # a JSON string holding quotes, a newline, unicode and the parameter's closing tag
    "note": f'say "hi"\nline 2 \u00fc \u4e2d\u6587 </{D}parameter> <{D}invoke name="y">',
}


def _args(**kw) -> str:
    return json.dumps(kw, ensure_ascii=False)


def _param(name: str, value, string: bool) -> str:
    text = value if string else json.dumps(value, ensure_ascii=False)
    flag = "true" if string else "false"
    return f'<{D}parameter name="{name}" string="{flag}">{text}</{D}parameter>\n'


def _invoke(name: str, *params: str) -> str:
    return f'<{D}invoke name="{name}">\n' + "".join(params) + f"</{D}invoke>\n"


def _block(block: str, *invokes: str) -> str:
    return f"\n\n<{D}{block}>\n" + "".join(invokes) + f"</{D}{block}>"


WEATHER = _invoke("get_weather", _param("city", "Zürich", True), _param("days", 3, False))
WRITE = _invoke("write_file", _param("path", "src/greet.py", True), _param("content", CODE, True))
UPDATE = _invoke("update_config", _param("config", CONFIG, False), _param("dry_run", True, False))
CALLS = [
    ToolCall(0, "get_weather", _args(city="Zürich", days=3)),
    ToolCall(1, "write_file", _args(path="src/greet.py", content=CODE)),
    ToolCall(2, "update_config", _args(config=CONFIG, dry_run=True)),
]

# V4 in thinking mode: the prompt ends with <｜Assistant｜><think>, so the output starts inside
# the reasoning; then text, then one block of three calls (the template's "\n\n" before it)
V4_TEXT = (
    "The user wants the weather, a file and a config change. Three calls.</think>"
    "I'll check the weather, write the file and update the config."
    + _block("tool_calls", WEATHER, WRITE, UPDATE)
)
V4_EVENTS = [
    Reasoning("The user wants the weather, a file and a config change. Three calls."),
    Content("I'll check the weather, write the file and update the config."),
    *CALLS,
]


def tokens(text: str) -> list[str]:
    """A plausible tokenisation: ｜DSML｜ and the think tags whole, words in short pieces."""
    return re.findall(r"｜DSML｜|</?think>|[A-Za-z]{1,5}|\d{1,3}|\s+|.", text, re.S)


def _feed(syntax, pieces: list[str], opens: bool = False, truncated: bool = False):
    parser = make_output_parser(syntax, TOOLS, start_in_reasoning=opens)
    events: list[ParsedEvent] = []
    for p in pieces:
        events += parser.feed(p)
    return merge(events + parser.finish(truncated=truncated))


def _check(syntax, text: str, expected, opens: bool = False) -> None:
    """One-shot, every split (char by char, cut at each position) and token by token."""
    parser = make_output_parser(syntax, TOOLS, start_in_reasoning=opens)
    assert merge(parser.feed(text) + parser.finish()) == expected
    for pieces in ([text], list(text), tokens(text)):
        assert _feed(syntax, pieces, opens) == expected, pieces
    for i in range(1, len(text)):
        assert _feed(syntax, [text[:i], text[i:]], opens) == expected, i


def _no_markup(events) -> None:
    for ev in events:
        if isinstance(ev, Content):
            assert D not in ev.text and "<｜" not in ev.text and "</" not in ev.text, ev


def test_v4_reasoning_text_and_three_calls_in_one_block():
    assert tokens(V4_TEXT).count(D) == V4_TEXT.count(D)  # the marker is always one token
    _check(V4, V4_TEXT, V4_EVENTS, opens=True)


def test_v4_streams_each_call_when_its_invocation_closes():
    parser = make_output_parser(V4, TOOLS, start_in_reasoning=True)
    cut = V4_TEXT.index(WRITE)  # the first invocation closed, the second not begun
    first = merge(parser.feed(V4_TEXT[:cut]))
    assert first == V4_EVENTS[:3]
    rest = merge(parser.feed(V4_TEXT[cut:]) + parser.finish())
    assert rest == CALLS[1:]


def test_v3_2_non_thinking_calls_text_after_and_a_second_block():
    # V3.2 without thinking: the prompt ends with </think>; the block is <｜DSML｜function_calls>
    text = (
        "Let me look both up.\n\n"
        + _block("function_calls", WEATHER, _invoke("get_weather", _param("city", "Oslo", True)))
        + "\nDone with the lookups; now the file."
        + _block("function_calls", WRITE)
    )
    expected = [
        Content("Let me look both up."),
        CALLS[0],
        ToolCall(1, "get_weather", _args(city="Oslo")),
        Content("\nDone with the lookups; now the file."),
        ToolCall(2, "write_file", _args(path="src/greet.py", content=CODE)),
    ]
    _check(V3_2, text, expected)
    assert not prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜></think>")
    assert prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜><think>")


def test_thinking_written_by_the_model_then_calls_without_text():
    text = "<think>\nNeed the config.\n</think>" + _block("tool_calls", UPDATE)
    _check(V4, text, [Reasoning("Need the config.\n"), ToolCall(0, *_update())])


def _update() -> tuple[str, str]:
    return "update_config", _args(config=CONFIG, dry_run=True)


def test_values_spelled_as_models_do():
    """JSON with padding and escapes, attributes in the other order, a mislabelled integer,
    a number where the schema wants a string, no string attribute at all, an unknown tool."""
    text = _block(
        "tool_calls",
        f'<{D}invoke name="get_weather">\n'
        f'<{D}parameter string="true" name="city">  two spaces kept </{D}parameter>\n'
        f'<{D}parameter name="days" string="true">4</{D}parameter>\n'
        f"</{D}invoke>\n",
        f'<{D}invoke name="update_config">\n'
        f'<{D}parameter name="config" string="false">\n {{"a": "\\u00fc\\n\\"q\\"", "b": [1.5e3, -2]}} \n</{D}parameter>'
        f'<{D}parameter name="dry_run">false</{D}parameter>\n'
        f"</{D}invoke>\n",
        f'<{D}invoke name="write_file">\n'
        f'<{D}parameter name="path" string="false">12345</{D}parameter>\n'
        f"</{D}invoke>\n",
        f'<{D}invoke name="search">\n'
        f'<{D}parameter name="q" string="false">not json</{D}parameter>\n'
        f'<{D}parameter name="n" string="false">5</{D}parameter>\n'
        f"</{D}invoke>\n",
    )
    expected = [
        ToolCall(0, "get_weather", _args(city="  two spaces kept ", days=4)),
        ToolCall(
            1, "update_config", _args(config={"a": 'ü\n"q"', "b": [1500.0, -2]}, dry_run=False)
        ),
        ToolCall(2, "write_file", _args(path="12345")),
        ToolCall(3, "search", _args(q="not json", n=5)),
    ]
    _check(V4, text, expected)


def test_text_that_only_looks_like_markup_stays_text():
    text = f"Tags start with <{D} and < is less; see <{D}tool_call> and <{D}tool_calls"
    _check(V4, text, [Content(text)])


def test_a_broken_block_is_read_loosely_or_given_back():
    # stray text between invocations: the calls around it still decode
    stray = _block(
        "tool_calls", WEATHER, "I mean:\n", _invoke("get_weather", _param("city", "Oslo", True))
    )
    expected = [CALLS[0], ToolCall(1, "get_weather", _args(city="Oslo"))]
    _check(V4, stray + " ok", [*expected, Content(" ok")])
    # no invocation at all: the block comes back as text
    empty = f"a<{D}tool_calls>\nnothing to call\n</{D}tool_calls>b"
    _check(V4, empty, [Content(empty)])


def test_a_stop_string_inside_a_call_gives_its_text_back():
    text = "ok" + _block("tool_calls", WEATHER, WRITE)
    cut = text.index(WRITE) + 40
    events = _feed(V4, [text[:cut]])  # finish() without truncation: a stop string
    # the closed call went out; the open one comes back as the text after it
    assert events == [Content("ok"), CALLS[0], Content(text[text.index(WRITE) - 1 : cut])]
    # stopped right after the opening tag, or between calls
    assert _feed(V4, [f"ok\n\n<{D}tool_calls>\n"]) == [Content(f"ok<{D}tool_calls>\n")]
    assert _feed(V4, [text[: text.index(WRITE)]]) == [Content("ok"), CALLS[0]]


ONE = {"get_weather": TOOLS["get_weather"]}
FFFD = "\ufffd"  # a character cut mid-bytes, as the detokenizer flushes it at the limit
CUTS = [
    # (text cut by the token limit, tools, the call expected)
    ("\n\n<｜DSML｜tool_", ONE, ("get_weather", {})),
    # cut in the whitespace before the block, or inside a bar (｜ is three bytes): the only tool
    ("\n", ONE, ("get_weather", {})),
    ("\n\n", ONE, ("get_weather", {})),
    (f"\n\n<{FFFD}", ONE, ("get_weather", {})),
    (f"\n\n<｜DSML{FFFD}", ONE, ("get_weather", {})),
    (f"\n\n<{D}tool_calls>\n<{FFFD}", ONE, ("get_weather", {})),
    (f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<｜DSML{FFFD}', TOOLS, ("get_weather", {})),
    (
        f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Zürich</{FFFD}',
        TOOLS,
        ("get_weather", {"city": "Zürich"}),
    ),
    (
        f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="days" string="false">3</｜DSML{FFFD}{FFFD}',
        TOOLS,
        ("get_weather", {"days": 3}),
    ),
    (f'<{D}tool_calls>\n<{D}invoke name="write_f', TOOLS, ("write_file", {})),
    (f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="ci', TOOLS, ("get_weather", {})),
    (
        f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Zü',
        TOOLS,
        ("get_weather", {"city": "Zü"}),
    ),
    (
        f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Zürich</{D}param',
        TOOLS,
        ("get_weather", {"city": "Zürich"}),
    ),
    (
        f'<{D}tool_calls>\n<{D}invoke name="update_config">\n<{D}parameter name="config" string="false">'
        '{"server": {"port": 8080, "hosts": ["a", "b',
        TOOLS,
        ("update_config", {"config": {"server": {"port": 8080, "hosts": ["a", "b"]}}}),
    ),
    (
        f'<{D}tool_calls>\n<{D}invoke name="update_config">\n'
        f'<{D}parameter name="dry_run" string="false">true</{D}parameter>\n<{D}parameter name="config" string="false">{{"note": "x</{D}para',
        TOOLS,
        ("update_config", {"dry_run": True, "config": {"note": f"x</{D}para"}}),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("text", "tools", "call"), CUTS)
def test_a_call_cut_by_the_token_limit_is_a_partial_call(text, tools, call):
    for pieces in ([text], list(text), tokens(text)):
        parser = make_output_parser(V4, tools)
        events = []
        for p in pieces:
            events += parser.feed(p)
        events = merge(events + parser.finish(truncated=True))
        (ev,) = events
        assert isinstance(ev, ToolCall) and ev.partial, events
        assert (ev.name, json.loads(ev.arguments)) == call
        assert arguments_object(ev.arguments) == call[1]


def test_two_tools_and_a_cut_before_the_name_give_no_call_and_no_markup():
    events = _feed(V4, [f"Sure.\n\n<{D}tool_calls>\n<{D}inv"], truncated=True)
    assert events == [Content("Sure.")]


def test_whitespace_is_a_cut_call_only_when_it_is_all_the_one_tool_output_holds():
    """Whitespace alone, cut by the limit, is a call cut before its block only when nothing
    else was written and there is one tool (a forced call starts with the template's
    ``\\n\\n``); otherwise it stays text, and a stop keeps it text."""

    def feed(text: str, tools, truncated: bool = True) -> list[ParsedEvent]:
        parser = make_output_parser(V4, tools)
        return merge(parser.feed(text) + parser.finish(truncated=truncated))

    assert feed("\n\n", ONE) == [ToolCall(0, "get_weather", "{}", partial=True)]
    assert feed("\n\n", TOOLS) == [Content("\n\n")]
    assert feed("\n\n", ONE, truncated=False) == [Content("\n\n")]
    assert feed("Sure.\n\n", ONE) == [Content("Sure.\n\n")]
    assert feed(_block("tool_calls", WEATHER) + "\n\n", ONE) == [CALLS[0], Content("\n\n")]
    # a U+FFFD that cannot be a cut bar is text
    assert feed(f"a <{FFFD}", ONE, truncated=False) == [Content(f"a <{FFFD}")]
    assert feed(f"<{FFFD}b", ONE) == [Content(f"<{FFFD}b")]


def test_cut_anywhere_never_shows_markup_and_keeps_what_was_written():
    """Every prefix of the V4 sample, finished by the token limit: the reasoning and text
    so far, the calls closed so far, at most one partial call whose arguments are the
    expected ones as far as written (strings a prefix, other values of the same type)."""
    full = {c.name: json.loads(c.arguments) for c in CALLS}
    for cut in range(len(V4_TEXT) + 1):
        for pieces in ([V4_TEXT[:cut]], tokens(V4_TEXT[:cut])):
            events = _feed(V4, pieces, opens=True, truncated=True)
            _no_markup(events)
            calls = [e for e in events if isinstance(e, ToolCall)]
            assert [c.index for c in calls] == list(range(len(calls)))
            for call in calls[:-1]:
                assert call == CALLS[call.index]
            if not calls:
                continue
            last = calls[-1]
            if not last.partial:
                assert last == CALLS[last.index]
                continue
            assert last.name == CALLS[last.index].name, cut
            for key, value in json.loads(last.arguments).items():
                want = full[last.name][key]
                if isinstance(want, str):
                    assert want.startswith(value), (cut, key, value)
                else:
                    assert type(value) is type(want), (cut, key, value)


def test_detected_from_the_v4_and_v3_2_templates():
    """Excerpts written for this test: the markers the real templates use, built from a
    dsml_token variable as they do, so the tags never appear whole."""
    v4_template = (
        "{%- set dsml_token = '｜DSML｜' -%}{%- set thinking_start_token = '<think>' -%}"
        "{%- set thinking_end_token = '</think>' -%}"
        "{{ '<' + dsml_token + 'tool_calls>\\n' }}{% for tool in message['tool_calls'] %}"
        "{{ '<' + dsml_token + 'invoke name=\"' + tool['function']['name'] + '\">\\n' }}"
        "{{ '</' + dsml_token + 'invoke>\\n' }}{% endfor %}{{ '</' + dsml_token + 'tool_calls>' }}"
        "<tool_result>{{ message['content'] }}</tool_result><｜end▁of▁sentence｜>"
    )
    v3_2_template = (
        '{%- set dsml_token = "｜DSML｜" -%}{%- set thinking_start_token = "<think>" -%}'
        "{%- if message.get('tool_calls') -%}<{{ dsml_token }}function_calls>"
        '<{{ dsml_token }}invoke name="{{ tool_call.function.name }}">'
        '<{{ dsml_token }}parameter name="{{ key }}" string="true">'
        "</{{ dsml_token }}function_calls>{%- endif -%}<function_results><result>"
    )
    for family in ("deepseek_v3", "unknown_family", "qwen3_moe"):
        assert detect_syntax(family, v4_template) == V4
        assert detect_syntax(family, v3_2_template) == V3_2


def test_anchors_are_the_turn_and_thinking_tokens():
    kinds = dict(DEEPSEEK_DSML_ANCHORS)
    assert kinds["</think>"] == "end_of_thinking"
    assert {k for k, v in kinds.items() if v == "end_of_turn"} == {
        "<｜User｜>",
        "<｜Assistant｜>",
        "<｜end▁of▁sentence｜>",
    }
    assert set(kinds.values()) <= {
        "end_of_turn",
        "end_of_thinking",
        "tool_call_start",
        "tool_call_end",
        "tool_output_start",
        "tool_output_end",
    }


def _forced_accepts(grammars, syntax, text: str) -> bool:  # noqa: F811
    factory, tok, _, eos = grammars
    c = factory.forced_tool_call(syntax, [("get_weather", SCHEMA), ("noop", None)])
    ids = tok.encode(text, add_special_tokens=False).ids + [eos]
    return all(c._matcher.accept_token(t) for t in ids) and c.is_terminated()


def _forced_call(block: str, *params: str, name: str = "get_weather") -> str:
    return _block(block, _invoke(name, *params))


def test_forced_call_grammar_accepts_a_well_formed_call_and_rejects_others(grammars):  # noqa: F811
    city, days = _param("city", "Oslo", True), _param("days", 2, False)
    tags = _param("tags", [True, False], False)
    good = {
        V4: [_forced_call("tool_calls", city, days), _forced_call("tool_calls", city, days, tags)],
        V3_2: [_forced_call("function_calls", city, days)],
    }
    bad = {
        V4: [
            _forced_call("function_calls", city, days),  # V3.2's block in V4's grammar
            _forced_call("tool_calls", _param("city", "Oslo", False), days),  # string as JSON
            _forced_call("tool_calls", city, _param("days", "2", True)),  # integer as text
            _forced_call("tool_calls", city),  # a required parameter missing
            _forced_call("tool_calls", city, _param("days", 9, False)),  # out of range
            _forced_call("tool_calls", city, days, name="get_time"),  # not an allowed tool
            "Sure." + _forced_call("tool_calls", city, days),  # text first
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
            "</tool_call>",
        ],
        V3_2: [_forced_call("tool_calls", city, days)],
    }
    for syntax in (V4, V3_2):
        for text in good[syntax]:
            assert _forced_accepts(grammars, syntax.tools, text), text
            (call,) = run(syntax, text, [text])
            assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Oslo"
        for text in bad[syntax]:
            assert not _forced_accepts(grammars, syntax.tools, text), text
    noop = _block("tool_calls", f'<{D}invoke name="noop">\n</{D}invoke>\n')
    assert _forced_accepts(grammars, ToolSyntax.DEEPSEEK_DSML, noop)
    assert run(V4, noop, [noop]) == [ToolCall(0, "noop", "{}")]


@pytest.mark.parametrize("syntax", [V4, V3_2])
@pytest.mark.parametrize("seed", range(3))
def test_forced_call_from_random_logits_parses(grammars, syntax, seed):  # noqa: F811
    factory, tok, vocab, eos = grammars
    tools = [("get_weather", SCHEMA), ("noop", None)]
    ids = sample_under(factory.forced_tool_call(syntax.tools, tools), vocab, seed)
    assert ids[-1] == eos
    text = tok.decode(ids[:-1], skip_special_tokens=False)
    (call,) = run(syntax, text, [text])
    assert isinstance(call, ToolCall), text
    args = json.loads(call.arguments)
    if call.name == "noop":
        assert args == {}
        return
    assert {"city", "days"} <= set(args) <= {"city", "days", "tags"}
    assert isinstance(args["city"], str) and len(args["city"]) <= 8
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 5
    assert all(isinstance(t, bool) for t in args.get("tags", []))
