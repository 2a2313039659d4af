"""Chat templates render exactly as transformers' apply_chat_template(tokenize=False)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
from transformers import AutoTokenizer

from freetokend.engine.chat_template import ChatTemplate, ChatTemplateError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <b>now</b>, e.g. Zürich",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
CALL_STR = {
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Köln"}'},
}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "plain": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me a joke about 日本"},
    ],
    "no_system": [{"role": "user", "content": "Hi"}],
    "tool_round": [
        {"role": "user", "content": "Weather in Paris and Köln?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, CALL_STR]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Köln."},
        {"role": "user", "content": "Thanks"},
    ],
    "text_and_call": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
        {"role": "tool", "content": "ok"},
    ],
    "reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two plus two"},
        {"role": "assistant", "content": "yes", "thinking": "old name for reasoning"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "3+3?"}],
        },
    ],
}


@pytest.fixture(scope="module")
def ours(builtin_model_dir: Path) -> ChatTemplate:
    return ChatTemplate.from_dir(builtin_model_dir)


@pytest.fixture(scope="module")
def hf(builtin_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(builtin_model_dir)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("gen_prompt", [False, True])
def test_builtin_template_matches_transformers(
    ours: ChatTemplate, hf: Any, name: str, with_tools: bool, gen_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    tools = TOOLS if with_tools else None
    before = copy.deepcopy(messages)
    got = ours.render(messages, tools=tools, add_generation_prompt=gen_prompt)
    want = hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=gen_prompt
    )
    assert got == want
    assert messages == before  # the caller's messages are not modified
    assert got.endswith("<|im_start|>assistant\n") == gen_prompt


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_template_kwarg(ours: ChatTemplate, hf: Any, enable_thinking: bool) -> None:
    messages = CONVERSATIONS["plain"]
    got = ours.render(messages, enable_thinking=enable_thinking)
    want = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    assert got == want
    assert got.endswith("<think>\n\n</think>\n\n") == (not enable_thinking)


def test_builtin_template_content(ours: ChatTemplate) -> None:
    text = ours.render(CONVERSATIONS["tool_round"], tools=TOOLS)
    assert text.startswith("<|im_start|>system\n")
    assert json.dumps(TOOLS, ensure_ascii=False) in text  # tools as one JSON list, not escaped
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert '"arguments": {"city": "Köln"}}' in text  # string arguments pass through verbatim
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain" in text
    )
    reasoning = ours.render(CONVERSATIONS["reasoning"])
    assert "<think>\ntwo plus two\n</think>\n\n4<|im_end|>" in reasoning
    assert "<think>\nold name for reasoning\n</think>" in reasoning
    assert "and 3+3?<|im_end|>" in reasoning


class Fn(msgspec.Struct):
    name: str
    arguments: str


class Call(msgspec.Struct):
    function: Fn
    id: str | None = None


class Msg(msgspec.Struct):
    role: str
    content: str | None = None
    tool_calls: list[Call] | None = None


def test_msgspec_messages_render_like_dicts(ours: ChatTemplate) -> None:
    structs = [
        Msg("user", "hi"),
        Msg("assistant", None, [Call(Fn("get_weather", '{"city": "Köln"}'))]),
    ]
    dicts: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"function": CALL_STR["function"], "id": None}]},
    ]
    assert ours.render(structs) == ours.render(dicts)


# --- other templates: features of the transformers environment -----------------------------

FEATURES = """\
{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m.role == 'stop' %}{% break %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {% generation %}[{{ m.role }}] {{ m.content }}{% endgeneration %}
{% endfor %}
count={{ ns.n }} {{ dict(a=1) | tojson }} {{ tools | tojson(indent=2, sort_keys=True) }}
{{ {'html': '<&>', 'u': 'é'} | tojson }} {{ eos_token }}{{ flavour | default('none') }}
{% if add_generation_prompt %}GO{% endif %}
"""


def make_dir(src: Path, dst: Path, tok_cfg: dict[str, Any], jinja: str | None = None) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(src / name, dst / name)
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    if jinja is not None:
        (dst / "chat_template.jinja").write_text(jinja)
    return dst


def both(d: Path, messages: list[dict], **kwargs: Any) -> tuple[str, str]:
    ours = ChatTemplate.from_dir(d).render(messages, **kwargs)
    theirs = AutoTokenizer.from_pretrained(d).apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=kwargs.pop("add_generation_prompt", True),
        **kwargs,
    )
    assert isinstance(theirs, str)
    return ours, theirs


def test_environment_features_match(builtin_model_dir: Path, tmp_path: Path) -> None:
    cfg = {
        "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
        "chat_template": FEATURES,
    }
    d = make_dir(builtin_model_dir, tmp_path / "m", cfg)
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "stop", "content": "-"},
        {"role": "user", "content": "never"},
    ]
    for kwargs in ({"tools": TOOLS}, {"flavour": "mint", "add_generation_prompt": False}):
        got, want = both(d, messages, **dict(kwargs))
        assert got == want
    assert "count=2" in got and "never" not in got and '"html": "<&>"' in got and "mint" in got


def test_named_templates_and_jinja_file(builtin_model_dir: Path, tmp_path: Path) -> None:
    named = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    d = make_dir(builtin_model_dir, tmp_path / "named", {"chat_template": named})
    msgs = [{"role": "user", "content": "x"}]
    assert both(d, msgs) == ("D1", "D1")
    assert both(d, msgs, tools=TOOLS) == ("T1", "T1")
    j = make_dir(
        builtin_model_dir, tmp_path / "j", {"chat_template": "not me"}, jinja="J{{ 1 + 1 }}"
    )
    assert both(j, msgs) == ("J2", "J2")


def test_strftime_now(builtin_model_dir: Path, tmp_path: Path) -> None:
    d = make_dir(builtin_model_dir, tmp_path / "m", {"chat_template": "{{ strftime_now('%Y') }}"})
    year = ChatTemplate.from_dir(d).render([])
    assert year.isdigit() and len(year) == 4 and int(year) >= 2024


# --- errors --------------------------------------------------------------------------------


def test_missing_template_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_dir(tmp_path)


def test_template_errors_become_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate({"default": "{% if %}"})
    boom = ChatTemplate({"default": "{{ raise_exception('no system role, ' + messages[0].role) }}"})
    with pytest.raises(ChatTemplateError, match="no system role, user"):
        boom.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # the immutable sandbox refuses mutation
        ChatTemplate({"default": "{{ messages.append(1) }}"}).render([])
    with pytest.raises(ChatTemplateError):  # namespaces refuse private names
        ChatTemplate({"default": "{% set ns = namespace(_x=1) %}"}).render([])
    builtin_role = ChatTemplate({"default": "{{ messages[0].role }}"})
    assert builtin_role.render([{"role": "user", "content": None}]) == "user"


def test_values_nested_past_the_stack_are_a_template_error() -> None:
    """The value conversion (plain dicts and lists for the template) refuses, never crashes."""
    deep: object = "x"
    for _ in range(5000):
        deep = [deep]
    tpl = ChatTemplate({"default": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    with pytest.raises(ChatTemplateError, match="nest too deeply"):
        tpl.render([{"role": "user", "content": deep}])
    with pytest.raises(ChatTemplateError, match="nest too deeply"):
        tpl.render([{"role": "user", "content": "x"}], extra=deep)
