"""A named tool_choice always comes back as a call of that function (issue 46, item 3), in
every tool syntax of the parser registry, whatever cuts it (max_tokens), streamed or not.

Two defects came back as raw markup in ``content``:

* the opener went missing: a tokenizer that marks ``<tool_call>`` (or any tag a parser reads)
  special had it skipped when ids became text, so the parser never saw the call begin. The
  grammar lets a model spell a tag as one special token or in pieces, so it happened in some
  samples only. The tags a parser reads are now written out (``parser_token_ids``);
* a delimiter inside an argument string: the grammar let a JSON string hold ``</tool_call>``,
  and the parser closed the call there. The grammar now keeps each syntax's tags out of its
  strings (where xgrammar can without dropping length bounds), and every parser reads a tag
  inside a string or value as text.

Sampling here is the server's path without the model: random logits (temperature 1, fixed
seeds) masked by the real forced-call grammar, ids through the real engine bridge,
``Generation`` (detokenizer, parser) and the registry's parser, over a tokenizer in which every
tag is a special token and logits that favour the tags.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import AddedToken

from freetokend.engine.core import EngineStats, StepOutput
from freetokend.engine.sampler import SamplingParams
from freetokend.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from freetokend.models.builtin_tokenizer import build_tokenizer
from freetokend.server.bridge import EngineBridge, Submission
from freetokend.server.constrained.formats import has_length_bounds
from freetokend.server.generation import Generation
from freetokend.server.metrics import Metrics
from freetokend.server.parsers.base import Content, Reasoning, ToolCall, arguments_object
from freetokend.server.parsers.registry import (
    _TOOL_PARSERS,
    REASONING_MARKERS,
    TOOL_MARKERS,
    OutputSyntax,
    ReasoningSyntax,
    ToolSyntax,
    make_output_parser,
)
from freetokend.server.service import parser_token_ids, special_tokens_skipped

# every tool syntax the registry parses (a new one must be added to TOOL_MARKERS, and so here)
SYNTAXES = list(TOOL_MARKERS)
REASONING = {
    ToolSyntax.QWEN3_JSON: ReasoningSyntax.THINK,
    ToolSyntax.QWEN3_XML: ReasoningSyntax.THINK,
    ToolSyntax.GLM_XML: ReasoningSyntax.THINK,
    ToolSyntax.MINIMAX_XML: ReasoningSyntax.THINK,
    ToolSyntax.GEMMA4: ReasoningSyntax.GEMMA4_THOUGHT,
    ToolSyntax.HARMONY: ReasoningSyntax.HARMONY,
    ToolSyntax.DEEPSEEK_DSML: ReasoningSyntax.THINK,
    ToolSyntax.DEEPSEEK_DSML_V3_2: ReasoningSyntax.THINK,
    ToolSyntax.KIMI_K2: ReasoningSyntax.THINK,
}
ALL_TAGS = sorted(
    {t for tags in (*TOOL_MARKERS.values(), *REASONING_MARKERS.values()) for t in tags}
)
HARMONY_TAGS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>"]
NAME = "get_weather"
# no length bounds: the grammar filters the strings (see formats.py)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BOUNDED = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
}
OTHER = {"type": "object", "properties": {"zone": {"type": "string"}}}


def test_the_registry_syntaxes_are_all_here():
    assert set(SYNTAXES) == {*_TOOL_PARSERS, ToolSyntax.HARMONY} == set(REASONING)


@pytest.fixture(scope="module")
def marked(tmp_path_factory) -> tuple[Path, Tokenizer]:
    """The built-in tokenizer plus every parser tag as a SPECIAL token (as some checkpoints
    mark <tool_call>, GLM its <arg_key>, Gemma its <|"|>)."""
    folder = tmp_path_factory.mktemp("marked")
    backend = build_tokenizer()
    tags = [t for t in [*ALL_TAGS, *HARMONY_TAGS] if backend.token_to_id(t) is None]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tags])
    for t in ("<tool_call>", "</tool_call>", "<think>", "</think>"):  # plain in Qwen's files
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    backend.save(str(folder / "tokenizer.json"))
    tok = Tokenizer(backend)
    assert {tok.token_to_id(t) for t in ("<tool_call>", "<arg_key>")} <= tok.special_token_ids
    return folder / "tokenizer.json", tok


def stop_ids(tok: Tokenizer, syntax: ToolSyntax) -> list[int]:
    names = ["<|call|>"] if syntax is ToolSyntax.HARMONY else ["<|im_end|>"]
    ids = [i for n in names if (i := tok.token_to_id(n)) is not None]
    assert len(ids) == len(names), names
    return ids


@pytest.fixture(scope="module")
def factories(marked):
    from freetokend.server.constrained.constraint import GrammarFactory

    path, tok = marked
    return {s: GrammarFactory(path, tok.vocab_size, stop_ids(tok, s)) for s in SYNTAXES}


# --- the server's path, model aside ----------------------------------------------------------


class SampledEngine:
    """Random logits, masked by the request's grammar, sampled at temperature 1 from a seeded
    generator (the seed is the prompt's first id); tag tokens are favoured, so the special
    spelling of the opener and tags inside strings come up often."""

    def __init__(self, vocab: int, eos: set[int], favour: set[int]) -> None:
        self.vocab, self.eos = vocab, frozenset(eos)
        self.bias = torch.zeros(vocab)
        self.bias[sorted(favour)] = 4.0
        self._lock = threading.Lock()
        self._reqs: dict[str, Any] = {}

    def add_request(self, request_id, prompt_ids, params, constraint=None, *, checked=False):  # type: ignore[no-untyped-def]
        gen = torch.Generator().manual_seed(prompt_ids[0])
        with self._lock:
            self._reqs[request_id] = [gen, constraint, params.max_tokens, 0, len(prompt_ids)]

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._reqs.pop(request_id, None)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._reqs)

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._reqs), waiting=0, kv_pages_used=0, kv_pages_total=8)

    def step(self) -> list[StepOutput]:
        outs = []
        with self._lock:
            for rid, req in list(self._reqs.items()):
                gen, constraint, limit, sent, n_prompt = req
                logits = torch.randn(self.vocab, generator=gen) * 3 + self.bias
                constraint.fill_mask(logits)
                tid = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
                constraint.accept(tid)
                req[3] = sent = sent + 1
                stop = tid in self.eos
                done = stop or sent == limit
                if done:
                    del self._reqs[rid]
                reason = ("stop" if stop else "length") if done else None
                outs.append(StepOutput(rid, tid, -1.0, None, done, reason, n_prompt, 0))
        return outs


def sample_calls(marked, factories, syntax, schema, seeds, max_tokens) -> list[tuple]:
    """(events streamed by Generation, events of the whole text parsed at once, finish reason,
    text) per seed, as ModelService.start_chat sets a named forced call up."""
    path, tok = marked
    eos = set(stop_ids(tok, syntax))
    tools = {NAME: schema, "get_time": OTHER}
    # the tags, and the quote that ends a JSON string (so whole calls end within 400 tokens)
    favour = {tok.token_to_id(t) for t in [*ALL_TAGS, *HARMONY_TAGS, '"']} - eos
    engine = SampledEngine(tok.vocab_size, eos, favour)
    output = OutputSyntax(syntax, REASONING[syntax])
    # as ModelService.start_chat sets a forced call's text up
    skip, keep = special_tokens_skipped(output, True, parser_token_ids(tok, output))
    named = {NAME: tools[NAME]}  # the parser knows the named tool only (service.start_chat)

    def parser():  # type: ignore[no-untyped-def]
        # a prompt that left <think> open: the grammar still holds the output from token one
        return make_output_parser(
            output, named, start_in_reasoning=True, reasoning=False, padded=True
        )

    async def main() -> list[tuple]:
        metrics = Metrics()
        bridge = EngineBridge(engine, 8, 8, metrics)
        bridge.start(asyncio.get_running_loop())
        out = []
        for seed in seeds:
            constraint = factories[syntax].forced_tool_call(syntax, [(NAME, schema)])
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
            handle = bridge.submit(Submission(f"r{seed}", [seed], params, constraint))
            gen = Generation(
                bridge=bridge,
                handle=handle,
                tokenizer=tok,
                parser=parser(),
                stop=[],
                stop_token_ids=eos,
                skip_special_tokens=skip,
                want_logprobs=False,
                metrics=metrics,
                keep_special=keep,
            )
            _, events, _ = await gen.collect()
            gen.close()
            whole = parser()
            at_once = whole.feed(gen.text) + whole.finish(gen.finish_reason == "length")
            out.append((events, at_once, gen.finish_reason, gen.text))
        bridge.stop()
        return out

    return asyncio.run(main())


def check_one_call(events: list, finish: str, text: str) -> dict[str, Any]:
    calls = [e for e in events if isinstance(e, ToolCall)]
    others = [e for e in events if isinstance(e, Content | Reasoning) and e.text.strip()]
    assert len(calls) == 1 and not others, (text, events)
    (call,) = calls
    assert call.name == NAME, (text, call)
    assert call.partial == (finish == "length"), (finish, call)
    if call.partial:
        return arguments_object(call.arguments)
    args = json.loads(call.arguments)
    assert isinstance(args, dict) and isinstance(args.get("city"), str), (text, call)
    return args


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_a_sampled_named_call_is_always_that_call(marked, factories, syntax):
    """Whole calls (no cut): every seed is one call of the named tool whose arguments parse,
    streamed token by token and parsed at once alike. Before the fix most seeds of the
    tagged syntaxes came back as content (the special opener skipped)."""
    results = sample_calls(marked, factories, syntax, SCHEMA, range(8), max_tokens=400)
    for events, at_once, finish, text in results:
        assert finish == "stop", text
        args = check_one_call(events, finish, text)
        assert check_one_call(at_once, finish, text) == args
        for tag in TOOL_MARKERS[syntax]:  # the grammar kept the tags out of the strings
            assert tag not in args["city"], (tag, args)


@pytest.mark.parametrize("syntax", SYNTAXES)
@pytest.mark.parametrize("max_tokens", [1, 2, 5, 12, 40])
def test_a_cut_named_call_is_still_that_call(marked, factories, syntax, max_tokens):
    """Cut by max_tokens anywhere (inside the opener, the name, a string): still one call of
    the named tool, its arguments so far parse. A schema with length bounds: the grammar lets
    the tags into its strings, the parsers read them as text."""
    for schema in (SCHEMA, BOUNDED):
        results = sample_calls(marked, factories, syntax, schema, range(3), max_tokens)
        for events, at_once, finish, text in results:
            args = check_one_call(events, finish, text)
            assert check_one_call(at_once, finish, text) == args


# --- the grammar ------------------------------------------------------------------------------


def _accepts(factory, syntax, schema, text: str) -> bool:
    c = factory.forced_tool_call(syntax, [(NAME, schema)])
    return bool(c._matcher.accept_string(text))


# the arguments of a call to get_weather(city=VALUE) in each syntax, up to the closing tag
ARGS_TEXT = {
    ToolSyntax.QWEN3_JSON: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "VALUE"}}',
    ToolSyntax.QWEN3_XML: "<tool_call>\n<function=get_weather>\n<parameter=city>\nVALUE\n</parameter>",
    ToolSyntax.GLM_XML: "<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>VALUE</arg_value>",
    ToolSyntax.MINIMAX_XML: '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">VALUE</parameter>',
    ToolSyntax.GEMMA4: '<|tool_call>call:get_weather{city:<|"|>VALUE<|"|>}',
    ToolSyntax.HARMONY: '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "VALUE"}',
    ToolSyntax.DEEPSEEK_DSML: '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">VALUE</｜DSML｜parameter>',
    ToolSyntax.DEEPSEEK_DSML_V3_2: '\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">VALUE</｜DSML｜parameter>',
    ToolSyntax.KIMI_K2: '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "VALUE"}',
}  # fmt: skip


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_the_grammar_keeps_the_tags_out_of_argument_strings(factories, syntax):
    factory = factories[syntax]
    assert _accepts(factory, syntax, SCHEMA, ARGS_TEXT[syntax].replace("VALUE", "Oslo"))
    for tag in TOOL_MARKERS[syntax]:
        value = f"a{tag}b"
        assert not _accepts(factory, syntax, SCHEMA, ARGS_TEXT[syntax].replace("VALUE", value))
    fits, over = ("x" * 40, "x" * 41)
    assert _accepts(factory, syntax, BOUNDED, ARGS_TEXT[syntax].replace("VALUE", fits))
    if syntax is ToolSyntax.GEMMA4:  # xgrammar's gemma style has no length bounds: filtered
        assert _accepts(factory, syntax, BOUNDED, ARGS_TEXT[syntax].replace("VALUE", over))
        tagged = ARGS_TEXT[syntax].replace("VALUE", "a<tool_call|>b")
        assert not _accepts(factory, syntax, BOUNDED, tagged)
    else:  # length bounds stay (xgrammar would drop them to filter): 40 characters, not 41
        assert not _accepts(factory, syntax, BOUNDED, ARGS_TEXT[syntax].replace("VALUE", over))
    assert has_length_bounds(BOUNDED) and not has_length_bounds(SCHEMA)


# --- the parsers: a tag inside an argument is text ---------------------------------------------

Q = '<|"|>'
D = "｜DSML｜"
DSML_SYNTAXES = (ToolSyntax.DEEPSEEK_DSML, ToolSyntax.DEEPSEEK_DSML_V3_2)
# how a syntax writes a string argument: as is, up to the tag that ends it ("raw"), or as a JSON
# string ("json"); DSML writes both (string="true" and string="false" parameters)
STRING_FORMS = {
    ToolSyntax.QWEN3_JSON: ("json",),
    ToolSyntax.HARMONY: ("json",),
    ToolSyntax.KIMI_K2: ("json",),
    ToolSyntax.DEEPSEEK_DSML: ("raw", "json"),
    ToolSyntax.DEEPSEEK_DSML_V3_2: ("raw", "json"),
}


def string_text(syntax: ToolSyntax, value: str, form: str) -> str:
    """``value`` as a call's text spells it in ``form`` (a JSON string without its quotes)."""
    if form == "raw":
        return value
    return json.dumps(value, ensure_ascii=syntax not in DSML_SYNTAXES)[1:-1]


def call_text(syntax: ToolSyntax, value: str, form: str | None = None) -> str:
    """A whole call of get_weather(city=value, days=2) as a model writes it, the string in
    ``form`` (the syntax's first by default)."""
    form = form or STRING_FORMS.get(syntax, ("raw",))[0]
    assert form in STRING_FORMS.get(syntax, ("raw",)), (syntax, form)
    if syntax is ToolSyntax.QWEN3_JSON:
        args = json.dumps({"city": value, "days": 2})
        return f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    if syntax is ToolSyntax.QWEN3_XML:
        return (
            f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{value}\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
        )
    if syntax is ToolSyntax.GLM_XML:
        return (
            f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{value}</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
        )
    if syntax is ToolSyntax.MINIMAX_XML:
        return (
            f'<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">{value}'
            '</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>'
        )
    if syntax is ToolSyntax.GEMMA4:
        return f"<|tool_call>call:get_weather{{city:{Q}{value}{Q},days:2}}<tool_call|>"
    if syntax is ToolSyntax.KIMI_K2:
        args = json.dumps({"city": value, "days": 2})
        return (
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            f"<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>"
        )
    if syntax in DSML_SYNTAXES:
        block = D + ("function_calls" if syntax is ToolSyntax.DEEPSEEK_DSML_V3_2 else "tool_calls")
        raw = form == "raw"
        city = value if raw else f'"{string_text(syntax, value, form)}"'
        return (
            f'\n\n<{block}>\n<{D}invoke name="get_weather">\n'
            f'<{D}parameter name="city" string="{str(raw).lower()}">{city}</{D}parameter>\n'
            f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
            f"</{D}invoke>\n</{block}>"
        )
    args = json.dumps({"city": value, "days": 2})
    return (
        f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{args}<|call|>"
    )


# what a raw value cannot hold in a syntax: the tag that ends it (ambiguous by design); a JSON
# string holds any tag
VALUE_END = {
    ToolSyntax.QWEN3_XML: ("</parameter>", "<parameter="),
    ToolSyntax.GLM_XML: ("</arg_value>",),
    ToolSyntax.MINIMAX_XML: ("</parameter>",),
    ToolSyntax.GEMMA4: (Q,),
    ToolSyntax.DEEPSEEK_DSML: (f"</{D}parameter>",),
    ToolSyntax.DEEPSEEK_DSML_V3_2: (f"</{D}parameter>",),
}
DAYS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_tags_inside_an_argument_round_trip(syntax):
    """A string argument holding each syntax's tags (every syntax's, reasoning tags too)
    comes back whole: fed at once, character by character, and cut by the token limit."""
    output = OutputSyntax(syntax, REASONING[syntax])
    tools = {NAME: DAYS, "get_time": OTHER}
    for tag in ALL_TAGS + ['"', "\\", "}", "{"]:
        for form in STRING_FORMS.get(syntax, ("raw",)):
            if form == "raw" and tag in VALUE_END.get(syntax, ()):
                continue
            value = f"x {tag} yz"
            text = call_text(syntax, value, form)
            for pieces in ([text], list(text)):
                parser = make_output_parser(output, tools, reasoning=False)
                events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
                # compared as JSON: a parser may write non-ASCII characters unescaped
                assert [(type(e), e.name) for e in events] == [(ToolCall, NAME)], (tag, events)
                (call,) = events
                assert not call.partial, (tag, events)
                assert json.loads(call.arguments) == {"city": value, "days": 2}, (tag, events)
            # cut inside the value, after the tag
            written = string_text(syntax, value, form)
            cut = text[: text.index(written) + len(written) - 1]
            parser = make_output_parser(output, tools, reasoning=False)
            events = parser.feed(cut) + parser.finish(truncated=True)
            (call,) = events
            assert call.name == NAME and call.partial, (tag, events)
            # all of it, or (a tag cut at the very end looks like a tag the limit cut) up to it
            city = arguments_object(call.arguments)["city"]
            assert city == value[:-1] or ("<" in tag and value.startswith(city)), (tag, call)


@pytest.mark.parametrize("syntax", [s for s in SYNTAXES if s is not ToolSyntax.HARMONY])
def test_an_unclosed_quote_still_ends_the_call_at_the_end(syntax):
    """Malformed output (a string or value never closed, then the closing tag and more): the
    call ends at that tag when the generation ends, as it did before quoting counted."""
    output = OutputSyntax(syntax, REASONING[syntax])
    good = call_text(syntax, "Oslo", STRING_FORMS.get(syntax, ("raw",))[-1])  # DSML: JSON
    broken = {
        ToolSyntax.QWEN3_JSON: good.replace('"Oslo"', '"Oslo'),
        ToolSyntax.QWEN3_XML: good.replace("Oslo\n</parameter>", "Oslo"),
        ToolSyntax.GLM_XML: good.replace("Oslo</arg_value>", "Oslo"),
        ToolSyntax.MINIMAX_XML: good.replace(
            '<parameter name="days">2</parameter>', '<parameter name="days">2'
        ),
        ToolSyntax.GEMMA4: good.replace(f"Oslo{Q}", "Oslo"),
        # the JSON string of a string="false" value
        ToolSyntax.DEEPSEEK_DSML: good.replace('"Oslo"', '"Oslo'),
        ToolSyntax.DEEPSEEK_DSML_V3_2: good.replace('"Oslo"', '"Oslo'),
        ToolSyntax.KIMI_K2: good.replace('"Oslo"', '"Oslo'),
    }[syntax]
    # (MiniMax: a value left open runs to the next </parameter>, so nothing follows here)
    follow = "" if syntax is ToolSyntax.MINIMAX_XML else good
    parser = make_output_parser(output, {NAME: DAYS})
    events = parser.feed(broken + " after " + follow) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert calls and calls[-1].name == NAME and json.loads(calls[-1].arguments)["city"] == "Oslo"
    assert "after" in "".join(e.text for e in events if isinstance(e, Content))


def test_harmony_unclosed_string_still_ends_the_call_at_the_end():
    output = OutputSyntax(ToolSyntax.HARMONY, ReasoningSyntax.HARMONY)
    good = call_text(ToolSyntax.HARMONY, "Oslo")
    broken = good.replace('"Oslo"', '"Oslo')
    parser = make_output_parser(output, {NAME: DAYS})
    events = parser.feed(broken + "<|start|>assistant" + good) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert calls[-1] == ToolCall(len(calls) - 1, NAME, json.dumps({"city": "Oslo", "days": 2}))


# --- the opener: special tags reach the parser ---------------------------------------------------


def test_special_tags_a_parser_reads_are_written_out(marked):
    """Unconstrained (tool_choice auto), special tokens are skipped but the parser's tags;
    a grammar's output skips none; harmony never skips."""
    _, tok = marked
    output = OutputSyntax(ToolSyntax.QWEN3_JSON, ReasoningSyntax.THINK)
    ids = parser_token_ids(tok, output)
    skip, keep = special_tokens_skipped(output, False, ids)
    assert skip and keep == ids
    assert {tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>", "<think>")} <= keep
    assert tok.token_to_id("<arg_key>") not in keep  # another syntax's tag stays skipped
    xml = parser_token_ids(tok, OutputSyntax(ToolSyntax.QWEN3_XML, ReasoningSyntax.THINK))
    assert tok.token_to_id("<parameter") in xml  # a part of a tag (<parameter=) too
    assert special_tokens_skipped(output, True, ids) == (False, frozenset())
    harmony = OutputSyntax(ToolSyntax.HARMONY, ReasoningSyntax.HARMONY)
    assert special_tokens_skipped(harmony, False, ids) == (False, frozenset())
    ids = [tok.token_to_id("<|im_start|>"), tok.token_to_id("<tool_call>"), *tok.encode("{}")]
    ids += [tok.token_to_id("</tool_call>"), tok.token_to_id("<arg_key>")]
    for kept, want in ((keep, "<tool_call>{}</tool_call>"), (frozenset(), "{}")):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=True, keep_special=kept)
        assert "".join(detok.push(i) for i in ids) + detok.flush() == want
