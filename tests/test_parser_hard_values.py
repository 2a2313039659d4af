"""Realistic output with hard values, for GLM, MiniMax, DSML (V3.2 and V4), Gemma-4 and Kimi-K2
(issue 43 item 4, issue 46): reasoning, text and two calls in one message, one of them a
multi-line string holding every syntax's tags (but the one that ends a raw value in this
syntax), quotes, braces and backslashes, the other a nested JSON object. The text is what each
format's template writes (test_parser_round_trip's templates of ours); it is parsed at once,
character by character, cut in two at every position, and token by token with the built-in
tokenizer (in which every tag is a special token, as many checkpoints have them), and must give
the same reasoning, content and calls each time.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_forced_named_calls import ALL_TAGS, VALUE_END
from test_parser_round_trip import CASES, client_message
from test_parsers_deepseek_dsml import TOOLS as DSML_TOOLS
from tokenizers import AddedToken

from freetokend.engine.chat_template import ChatTemplate
from freetokend.models.builtin_tokenizer import build_tokenizer
from freetokend.server.parsers.base import Content, Reasoning, ToolCall, merge
from freetokend.server.parsers.registry import (
    detect_syntax,
    make_output_parser,
    prompt_opened,
    prompt_opens_reasoning,
)

SCHEMAS: dict[str, dict[str, Any]] = {n: DSML_TOOLS[n] for n in ("write_file", "update_config")}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": s}}
    for n, s in SCHEMAS.items()
]
CONFIG = {
    "server": {"port": 8080, "hosts": ["a", "b c"], "tls": None, "ratio": 0.25},
    "rules": [{"match": "*.py", "deny": False}, {"match": "Zürich/東京", "deny": True}],
}
REASONING = "I'll write the parser file, then turn the config on.\n\nTwo calls."
CONTENT = "Writing the file and updating the config."
SYNTAX_CASES = {name: case for name, case in CASES.items() if name.endswith("(ours)")}


def code(case_name: str) -> str:
    """A file that spells every tag a value may hold in this syntax, one per line."""
    syntax = detect_syntax(CASES[case_name].family, CASES[case_name].template).tools
    tags = [t for t in ALL_TAGS if t not in VALUE_END.get(syntax, ())]
    lines = [f'TAG_{i} = "{t}"  # {{"x": [1, 2]}} \\ ok' for i, t in enumerate(tags)]
    return "\n".join(['"""Every tag, as text."""', *lines, 'print(\'}\\"\', "{")', ""])


@pytest.fixture(scope="module")
def tokenizer():
    """The built-in tokenizer with every tag a special token."""
    tok = build_tokenizer()
    tags = [t for t in ALL_TAGS if tok.token_to_id(t) is None]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tags])
    return tok


def by_token(tok, text: str) -> list[str]:
    """``text`` as the tokenizer cuts it, each token's text (the pieces of a character split
    across tokens joined, as the detokenizer gives them)."""
    pieces, pending = [], []
    for i in tok.encode(text, add_special_tokens=False).ids:
        pending.append(i)
        piece = tok.decode(pending, skip_special_tokens=False)
        if "\ufffd" not in piece:
            pieces.append(piece)
            pending = []
    assert not pending and "".join(pieces) == text
    return pieces


def parse(syntax, prompt: str, pieces: list[str]):
    opens = prompt_opens_reasoning(prompt)
    parser = make_output_parser(
        syntax, SCHEMAS, start_in_reasoning=opens, opened=prompt_opened(prompt) if opens else ""
    )
    events = [ev for p in pieces for ev in parser.feed(p)]
    return merge(events + parser.finish())


def plain(events) -> list[tuple]:
    """Events compared with arguments as values (a parser may write JSON's spacing its way)."""
    return [
        (type(e).__name__, e.name, json.loads(e.arguments), e.partial)
        if isinstance(e, ToolCall)
        else (type(e).__name__, e.text)
        for e in events
    ]


@pytest.mark.parametrize("name", SYNTAX_CASES)
def test_hard_values_in_every_split(name: str, tokenizer) -> None:
    case = SYNTAX_CASES[name]
    template = ChatTemplate({"default": case.template})
    calls = [
        {"name": "write_file", "arguments": {"path": "src/tags.py", "content": code(name)}},
        {"name": "update_config", "arguments": {"config": CONFIG, "dry_run": False}},
    ]
    if "Kimi" in name:
        calls = [{**c, "id": f"functions.{c['name']}:{i}"} for i, c in enumerate(calls)]
    conversation = [{"role": "user", "content": "Add the tag table and turn the rules on."}]
    message = client_message(REASONING, CONTENT, calls)
    prompt = template.render(conversation, tools=TOOLS, add_generation_prompt=True)
    turn = template.render([*conversation, message], tools=TOOLS, add_generation_prompt=False)
    assert turn.startswith(prompt)
    generated = turn[len(prompt) :]
    end = next(e for e in case.ends if generated.endswith(e))
    generated = generated[: len(generated) - len(end)]
    syntax = detect_syntax(case.family, case.template)

    whole = parse(syntax, prompt, [generated])
    reasoning = "".join(e.text for e in whole if isinstance(e, Reasoning))
    assert reasoning in (REASONING, "")  # some templates write reasoning only before calls
    assert "".join(e.text for e in whole if isinstance(e, Content)) == CONTENT
    got = [(e.name, json.loads(e.arguments), e.partial) for e in whole if isinstance(e, ToolCall)]
    assert got == [(c["name"], c["arguments"], False) for c in calls]
    want = plain(whole)
    assert plain(parse(syntax, prompt, [*generated])) == want
    assert plain(parse(syntax, prompt, by_token(tokenizer, generated))) == want
    for i in range(1, len(generated)):
        assert plain(parse(syntax, prompt, [generated[:i], generated[i:]])) == want, i
