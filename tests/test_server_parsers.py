"""Output parsers (streamed in every possible split), syntax selection, and forced tool-call
grammars: a call sampled from RANDOM logits under the grammar always parses and satisfies
the tool's schema."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from server_support.daemon import state_dir

from freetokend.models.builtin import CHAT_TEMPLATE, ensure_builtin_model
from freetokend.server.parsers.base import Content, Reasoning, ToolCall, merge
from freetokend.server.parsers.registry import (
    OutputSyntax,
    ReasoningSyntax,
    ToolSyntax,
    detect_syntax,
    make_output_parser,
    prompt_opens_reasoning,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["city", "days"],
}
JSON_THINK = OutputSyntax(ToolSyntax.QWEN3_JSON, ReasoningSyntax.THINK)
XML_THINK = OutputSyntax(ToolSyntax.QWEN3_XML, ReasoningSyntax.THINK)
HARMONY = OutputSyntax(ToolSyntax.HARMONY, ReasoningSyntax.HARMONY)


def run(syntax, text: str, pieces: list[str], opens: bool = False, padded: bool = False):
    parser = make_output_parser(
        syntax, {"get_weather": SCHEMA}, start_in_reasoning=opens, padded=padded
    )
    events = []
    for p in pieces:
        events += parser.feed(p)
    events += parser.finish()
    return merge(events)


def splits(text: str):
    """The text in one piece, char by char, and cut at every single position."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def check_all_splits(syntax, text: str, expected, opens: bool = False) -> None:
    for pieces in splits(text):
        assert run(syntax, text, pieces, opens) == expected, pieces


def test_think_then_content_then_json_call():
    text = (
        '<think>\nplan it\n</think>\n\nSure.<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    )
    expected = [
        Reasoning("plan it"),  # the newline before </think> is the template's, not reasoning
        Content("Sure."),
        ToolCall(0, "get_weather", json.dumps({"city": "Oslo", "days": 2})),
    ]
    check_all_splits(JSON_THINK, text, expected)


def test_reasoning_opened_by_the_prompt():
    check_all_splits(
        JSON_THINK, "\nhmm</think>\n\nHi", [Reasoning("hmm"), Content("Hi")], opens=True
    )
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<think>\n\n</think>\n\n")


def test_broken_json_call_is_given_back_as_content():
    text = "a<tool_call>{oops</tool_call>b"
    check_all_splits(JSON_THINK, text, [Content("a<tool_call>{oops</tool_call>b")])


def test_two_calls_and_text_that_only_looks_like_a_tag():
    call = '<tool_call>{"name": "x", "arguments": {}}</tool_call>'
    expected = [Content("<tool "), ToolCall(0, "x", "{}"), ToolCall(1, "x", "{}"), Content("<")]
    check_all_splits(JSON_THINK, "<tool " + call + call + "<", expected)


def test_xml_call_converts_values_by_schema():
    text = (
        "ok\n<tool_call>\n<function=get_weather>\n<parameter=city>\n12 Main\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=tags>\n[true]\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    args = {"city": "12 Main", "days": 3, "tags": [True]}
    check_all_splits(
        XML_THINK, text, [Content("ok\n"), ToolCall(0, "get_weather", json.dumps(args))]
    )


def test_harmony_channels():
    text = (
        "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome", "days": 1}<|call|>'
    )
    expected = [
        Reasoning("think"),
        ToolCall(0, "get_weather", json.dumps({"city": "Rome", "days": 1})),
    ]
    check_all_splits(HARMONY, text, expected)
    final = "<|channel|>final<|message|>Hello there"  # <|return|> is EOS: not in the text
    check_all_splits(HARMONY, final, [Content("Hello there")])


def test_syntax_comes_from_the_template_then_the_family():
    # the built-in model is family qwen3_5_moe (default XML) but its template asks for JSON
    assert detect_syntax("qwen3_5_moe", CHAT_TEMPLATE).tools is ToolSyntax.QWEN3_JSON
    xml_template = "... <tool_call>\n<function=example_function_name>\n<parameter=x> ... <think>"
    assert detect_syntax("qwen3_moe", xml_template) == XML_THINK
    assert detect_syntax("gpt_oss", "{{ '<|channel|>' }}") == HARMONY
    assert detect_syntax("qwen3_next", "") == XML_THINK
    assert detect_syntax("mixtral", "{{ messages }}").tools is ToolSyntax.NONE
    assert detect_syntax("unknown_family", "").tools is ToolSyntax.NONE


@pytest.fixture(scope="module")
def grammars():
    from tokenizers import Tokenizer

    from freetokend.server.constrained.constraint import GrammarFactory

    model = ensure_builtin_model(state_dir())
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    eos = tok.token_to_id("<|im_end|>")
    return GrammarFactory(model / "tokenizer.json", vocab, [eos]), tok, vocab, eos


def sample_under(constraint, vocab: int, seed: int, limit: int = 400) -> list[int]:
    """Random logits, masked by the grammar, sampled until the grammar terminates."""
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(limit):
        logits = torch.randn(vocab, generator=gen) * 3
        constraint.fill_mask(logits)
        tid = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        constraint.accept(tid)
        ids.append(tid)
        if constraint.is_terminated():
            return ids
    raise AssertionError("the grammar did not terminate")


@pytest.mark.parametrize(
    "syntax",
    [
        ToolSyntax.QWEN3_JSON,
        ToolSyntax.QWEN3_XML,
        ToolSyntax.HARMONY,
        ToolSyntax.GLM_XML,
        ToolSyntax.MINIMAX_XML,
    ],
)
@pytest.mark.parametrize("seed", range(6))
def test_forced_call_from_random_logits_is_valid(grammars, syntax, seed):
    factory, tok, vocab, eos = grammars
    tools = [("get_weather", SCHEMA), ("noop", None)]
    ids = sample_under(factory.forced_tool_call(syntax, tools), vocab, seed)
    assert ids[-1] == eos
    text = tok.decode(ids[:-1], skip_special_tokens=False)
    reasoning = ReasoningSyntax.HARMONY if syntax is ToolSyntax.HARMONY else ReasoningSyntax.THINK
    # as the service reads a forced call (the grammar may pad an XML value with whitespace)
    events = run(OutputSyntax(syntax, reasoning), text, [text], padded=True)
    (call,) = events
    assert isinstance(call, ToolCall), events
    args = json.loads(call.arguments)
    if call.name == "noop":
        assert args == {}
        return
    assert call.name == "get_weather"
    assert {"city", "days"} <= set(args) <= {"city", "days", "tags"}
    assert isinstance(args["city"], str) and len(args["city"]) <= 8
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 5
    assert all(isinstance(t, bool) for t in args.get("tags", []))


def test_json_schema_constraint_from_random_logits(grammars):
    factory, tok, vocab, eos = grammars
    ids = sample_under(factory.json_schema(SCHEMA), vocab, seed=5)
    value = json.loads(tok.decode(ids[:-1]), strict=False)
    assert {"city", "days"} <= set(value) and 1 <= value["days"] <= 5


def test_unsupported_schema_is_a_value_error(grammars):
    factory = grammars[0]
    with pytest.raises(ValueError, match="bogus"):
        factory.json_schema({"type": "bogus"})


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                os.environ.get("FT_TEST_ACCELERATOR") != "cuda", reason="tests/gpu/check.sh"
            ),
        ),
    ],
)
def test_grammar_never_spells_a_surrogate(grammars, device):
    """xgrammar takes ``ED A0-BF xx`` (a UTF-16 surrogate in UTF-8 form, no valid UTF-8) as
    one string character; decoded, it is three U+FFFD, past ``maxLength``. Logits that favour
    exactly those bytes (ED first, then A0-BF, then 80-9F, then letters) must still give a
    string that is valid UTF-8 and within its length: ED followed by 80-9F (U+D000-U+D7FF).
    On CUDA logits too (tests/gpu/check.sh), where the mask crosses to the device."""
    factory, tok, vocab, eos = grammars
    decoded = factory.info.decoded_vocab
    byte_id = {b[0]: i for i, b in enumerate(decoded) if len(b) == 1}
    bias = torch.zeros(vocab)
    bias[byte_id[0xED]] = 40.0
    for b in range(0xA0, 0xC0):
        bias[byte_id[b]] = 30.0
    for b in range(0x80, 0xA0):
        bias[byte_id[b]] = 20.0
    for b in b"abcdefgh":
        bias[byte_id[b]] = 10.0
    bias[byte_id[ord('"')]] = 5.0
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}}
    schema["required"] = ["city"]
    forced = (ToolSyntax.QWEN3_JSON, [("get_weather", schema)])
    for constraint in (factory.json_schema(schema), factory.forced_tool_call(*forced)):
        ids = []
        for _ in range(200):
            with torch.inference_mode():  # as the engine's logits are
                logits = bias.to(device, copy=True)
            constraint.fill_mask(logits)  # outside it, as the engine calls it
            tid = int(logits.argmax())
            constraint.accept(tid)
            ids.append(tid)
            if constraint.is_terminated():
                break
        assert ids[-1] == eos
        raw = b"".join(decoded[i] for i in ids[:-1])
        assert b"\xed" in raw  # the favoured lead byte was taken ...
        text = raw.decode("utf-8")  # ... and only ever completed as valid UTF-8
        value = json.loads(text[text.index("{") : text.rindex("}") + 1])
        city = value.get("arguments", value)["city"]
        assert 1 <= len(city) <= 6 and "\ufffd" not in city


@pytest.mark.parametrize("syntax", [JSON_THINK, XML_THINK])
def test_lone_surrogate_escape_in_a_call_becomes_a_replacement_char(syntax):
    """``"\\ud800"`` is valid JSON a grammar lets through, but has no UTF-8 form: left in
    the arguments, encoding the response would fail."""
    if syntax is JSON_THINK:
        text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "R\\ud800m", '
        text += '"days": 2, "tags": ["\\ud83d\\ude00"]}}\n</tool_call>'
        want = {"city": "R\ufffdm", "days": 2, "tags": ["\U0001f600"]}
    else:
        text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nR\\udc00m\n</parameter>\n"
        text += '<parameter=days>\n2\n</parameter>\n<parameter=tags>\n["\\udbff"]\n</parameter>\n'
        text += "</function>\n</tool_call>"
        want = {"city": "R\\udc00m", "days": 2, "tags": ["\ufffd"]}
    (call,) = run(syntax, text, [text])
    assert isinstance(call, ToolCall)
    assert json.loads(call.arguments) == want
    call.arguments.encode("utf-8")
