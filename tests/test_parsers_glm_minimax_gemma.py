"""GLM-4.5/4.7, MiniMax-M2 and Gemma-4 output parsing on realistic output, streamed in every split."""

from __future__ import annotations

import json

from test_server_parsers import SCHEMA, check_all_splits, grammars, run  # noqa: F401

from freetokend.server.parsers.base import Content, Reasoning, ToolCall, arguments_object, merge
from freetokend.server.parsers.registry import (
    OutputSyntax,
    ReasoningSyntax,
    ToolSyntax,
    detect_syntax,
    make_output_parser,
)

GLM = OutputSyntax(ToolSyntax.GLM_XML, ReasoningSyntax.THINK)
MINIMAX = OutputSyntax(ToolSyntax.MINIMAX_XML, ReasoningSyntax.THINK)


def _args(**kw) -> str:
    return json.dumps(kw, ensure_ascii=False)


CONFIG = {"server": {"port": 8080, "hosts": ["a", "b"], "tls": None}, "debug": False}


def _tools_calls():
    """The two calls every sample makes: a string + integer one, and one with nested JSON
    (no schema for write_config: its values are decoded as JSON where they parse)."""
    return [
        ToolCall(0, "get_weather", _args(city="Zürich", days=3)),
        ToolCall(
            1,
            "write_config",
            _args(path="conf/app.json", content=CONFIG),
        ),
    ]


def test_glm45_think_text_and_two_calls():
    text = (
        "<think>The user wants the weather, then a config file.</think>\n"
        "I'll check the weather first.\n"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
        "Then the config:\n"
        "<tool_call>write_config\n<arg_key>path</arg_key>\n<arg_value>conf/app.json</arg_value>\n"
        f"<arg_key>content</arg_key>\n<arg_value>{json.dumps(CONFIG)}</arg_value>\n</tool_call>"
    )
    weather, config = _tools_calls()
    # GLM-4.5/4.6's templates write '\n' before each call: markup, not content
    expected = [
        Reasoning("The user wants the weather, then a config file."),
        Content("I'll check the weather first."),
        weather,
        Content("\nThen the config:"),
        config,
    ]
    check_all_splits(GLM, text, expected)


def test_glm47_compact_calls_opened_reasoning_and_a_string_that_looks_like_json():
    # GLM-4.7 drops the newlines; its template opens <think> in the prompt.
    text = (
        "plan</think>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>[1, 2]</arg_value>"
        "<arg_key>days</arg_key><arg_value>1</arg_value></tool_call>"
    )
    expected = [
        Reasoning("plan"),
        ToolCall(0, "get_weather", _args(city="Zürich", days=3)),
        # the schema says city is a string: kept as text even though it parses as JSON
        ToolCall(1, "get_weather", _args(city="[1, 2]", days=1)),
    ]
    check_all_splits(GLM, text, expected, opens=True)


def test_glm_body_without_a_name_is_given_back():
    text = "a<tool_call><arg_key>x</arg_key><arg_value>1</arg_value></tool_call>b"
    assert run(GLM, text, [text]) == [Content(text)]


def test_minimax_think_text_and_calls_in_two_blocks():
    text = (
        "<think>\nTwo lookups are needed.\n</think>\n\n"
        "Let me look that up.\n"
        '<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Zürich</parameter>\n<parameter name="days">3</parameter>\n'
        '</invoke>\n<invoke name="write_config">\n'
        '<parameter name="path">conf/app.json</parameter>\n'
        f'<parameter name="content">{json.dumps(CONFIG)}</parameter>\n'
        "</invoke>\n</minimax:tool_call>\n"
        "And one more:\n"
        '<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Oslo</parameter>\n<parameter name="days">1</parameter>\n'
        "</invoke>\n</minimax:tool_call>"
    )
    weather, config = _tools_calls()
    # MiniMax-M2's template writes '<think>\n' + reasoning + '\n</think>\n\n' + content, and
    # '\n' before a block: those separators are markup
    expected = [
        Reasoning("Two lookups are needed."),
        Content("Let me look that up."),
        weather,
        config,
        Content("\nAnd one more:"),
        ToolCall(2, "get_weather", _args(city="Oslo", days=1)),
    ]
    check_all_splits(MINIMAX, text, expected)


def test_minimax_reasoning_opened_by_the_prompt_and_a_block_without_calls():
    text = "hmm\n</think>\n\nok <minimax:tool_call>\nnothing here\n</minimax:tool_call>"
    expected = [Reasoning("hmm"), Content(text.split("</think>\n\n")[1])]
    check_all_splits(MINIMAX, text, expected, opens=True)


def test_syntax_detected_from_the_templates_and_the_families():
    glm_template = "{{'<tool_call>' + name}}{% for k, v in args %}<arg_key>{{k}}</arg_key>"
    assert detect_syntax("qwen3_moe", glm_template + "<think>") == GLM
    assert detect_syntax("glm4_moe", "") == GLM
    assert detect_syntax("glm4_moe_lite", "") == GLM
    assert detect_syntax("mixtral", '<minimax:tool_call><invoke name="x"><think>') == MINIMAX
    assert detect_syntax("minimax_m2", "") == MINIMAX


GEMMA = OutputSyntax(ToolSyntax.GEMMA4, ReasoningSyntax.GEMMA4_THOUGHT)
Q = '<|"|>'


def test_gemma4_thought_text_and_calls_with_nested_arguments():
    text = (
        "<|channel>thought\nNeed weather, then write {the} config.<channel|>"
        "Checking now.\n"
        f"<|tool_call>call:get_weather{{city:{Q}Zürich{Q},days:3}}<tool_call|>"
        f"<|tool_call>call:write_config{{path:{Q}conf/app.json{Q},"
        f"content:{{server:{{port:8080,hosts:[{Q}a{Q},{Q}b{Q}],tls:null}},debug:false}}}}"
        "<tool_call|>"
        " Both sent."
    )
    weather, config = _tools_calls()
    expected = [
        Reasoning("Need weather, then write {the} config."),
        Content("Checking now.\n"),
        weather,
        config,
        Content(" Both sent."),
    ]
    check_all_splits(GEMMA, text, expected)


def test_gemma4_strings_keep_notation_characters_and_bad_bodies_come_back():
    text = (
        f"<|tool_call>call:get_weather{{ city: {Q}a,b:{{c}}]{Q} , days : 2 , tags:[ true ,false]}}"
        "<tool_call|>"
    )
    expected = [ToolCall(0, "get_weather", _args(city="a,b:{c}]", days=2, tags=[True, False]))]
    check_all_splits(GEMMA, text, expected)
    for bad in (
        "<|tool_call>get_weather{}<tool_call|>",  # no call: prefix
        f"<|tool_call>call:get_weather{{city:{Q}Oslo}}<tool_call|>",  # unterminated string
        "<|tool_call>call:get_weather{days:2<tool_call|>",  # unclosed object
    ):
        assert run(GEMMA, bad, [bad]) == [Content(bad)], bad


def test_gemma4_syntax_from_the_template():
    template = "{{'<|channel>thought'}}...{{'<|tool_call>call:' + name}}"
    assert detect_syntax("qwen3_moe", template) == GEMMA


def test_gemma4_forced_call_grammar_accepts_what_the_parser_reads(grammars):  # noqa: F811
    """xgrammar's Gemma-4 style is an outside spelling of the notation: the text the parser
    decodes must be a complete sentence of the forced-call grammar, and JSON must not be."""
    factory, tok, _, eos = grammars
    tools = [("get_weather", SCHEMA), ("noop", None)]
    good = f"<|tool_call>call:get_weather{{city:{Q}Oslo{Q},days:2,tags:[true,false]}}<tool_call|>"
    bad = '<|tool_call>call:get_weather{"city":"Oslo","days":2}<tool_call|>'
    for text, ok in ((good, True), (bad, False)):
        c = factory.forced_tool_call(ToolSyntax.GEMMA4, tools)
        ids = tok.encode(text, add_special_tokens=False).ids + [eos]
        accepted = all(c._matcher.accept_token(t) for t in ids)
        assert accepted == ok and c.is_terminated() == ok, text
    (call,) = run(GEMMA, good, [good])
    assert call == ToolCall(0, "get_weather", _args(city="Oslo", days=2, tags=[True, False]))


DEEP = 2000  # levels: far past Python's recursion limit for a recursive reader


def _pieces(text: str):
    """The text whole, in 7-character pieces, and cut once in the middle of the nesting."""
    yield [text]
    yield [text[i : i + 7] for i in range(0, len(text), 7)]
    yield [text[: len(text) // 2], text[len(text) // 2 :]]


def _run_cut(syntax, pieces: list[str], truncated: bool):
    parser = make_output_parser(syntax, {"get_weather": SCHEMA})
    events = []
    for p in pieces:
        events += parser.feed(p)
    return merge(events + parser.finish(truncated=truncated))


def test_gemma4_deeply_nested_arguments_come_back_as_text_streamed_or_not():
    """Model output nested ~2000 levels deep overflowed the recursive reader (RecursionError:
    a 500, or an internal-error event mid-stream); it is malformed output like any other, and
    comes back as text. Nesting up to the request limit (64) still decodes."""
    deep = "{a:" * DEEP + "1" + "}" * DEEP
    for inner in (deep, "[" * DEEP + "]" * DEEP):
        text = f"<|tool_call>call:get_weather{{city:{inner}}}<tool_call|>"
        for pieces in _pieces(text):
            for truncated in (False, True):
                assert _run_cut(GEMMA, pieces, truncated) == [Content(text)]
    # at the bound: the arguments object plus 63 levels decode; one more level is text
    ok = f"<|tool_call>call:get_weather{{a:{'[' * 63}{']' * 63}}}<tool_call|>"
    (call,) = run(GEMMA, ok, [ok])
    value: object = json.loads(call.arguments)["a"]
    for _ in range(62):
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert value == []
    over = ok.replace("{a:[", "{a:[[").replace("]}", "]]}")
    assert run(GEMMA, over, [over]) == [Content(over)]


def test_gemma4_deep_call_cut_by_the_token_limit_is_still_a_call():
    """A deep call cut by max_tokens: the tool call survives (arguments that parse: none),
    rather than a RecursionError ending the stream."""
    text = "<|tool_call>call:get_weather{city:" + "{a:" * DEEP
    for pieces in _pieces(text):
        assert _run_cut(GEMMA, pieces, True) == [ToolCall(0, "get_weather", "{}", partial=True)]


def test_every_syntax_survives_deeply_nested_arguments():
    """The other parsers decode argument values with loads_bounded: a value nested ~2000
    levels deep is kept as text (or the call given back as text), never a RecursionError,
    and what reaches an API layer converts to an object (Anthropic's input) without one."""
    deep = '{"a":' * DEEP + "1" + "}" * DEEP
    head = "<|start|>assistant<|channel|>commentary to=functions.get_weather "
    samples = {
        GLM: f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{deep}</arg_value>"
        "\n</tool_call>",
        MINIMAX: f'<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="days">'
        f"{deep}</parameter>\n</invoke>\n</minimax:tool_call>",
        OutputSyntax(ToolSyntax.QWEN3_XML, ReasoningSyntax.THINK): "<tool_call>\n"
        f"<function=get_weather>\n<parameter=days>\n{deep}\n</parameter>\n</function>\n"
        "</tool_call>",
        OutputSyntax(ToolSyntax.QWEN3_JSON, ReasoningSyntax.THINK): "<tool_call>"
        f'{{"name": "get_weather", "arguments": {deep}}}</tool_call>',
        OutputSyntax(ToolSyntax.HARMONY, ReasoningSyntax.HARMONY): head
        + f"<|constrain|>json<|message|>{deep}<|call|>",
    }
    for syntax, text in samples.items():
        for cut in (len(text), len(text) // 2):  # whole, and cut inside the nesting
            for pieces in _pieces(text[:cut]):
                for truncated in (False, True):
                    events = _run_cut(syntax, pieces, truncated)
                    assert events, syntax
                    for ev in events:
                        if isinstance(ev, ToolCall):
                            assert ev.name == "get_weather"
                            assert isinstance(arguments_object(ev.arguments), dict)
                        else:
                            # a call stopped inside its body comes back with its closing tag
                            assert isinstance(ev, Content)
                            assert ev.text.removesuffix("</tool_call>") in text
