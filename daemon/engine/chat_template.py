"""Chat templates: render a conversation to the prompt text, as transformers'
``apply_chat_template(tokenize=False)`` does.

Same environment (jinja2 ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loop
controls, a no-op ``{% generation %}`` block), same helpers (``raise_exception``, ``tojson``
without HTML escaping, ``strftime_now``, a restricted ``dict`` and ``namespace``) and the same
inputs (messages with None-valued keys dropped and reasoning aliased, ``tools``, ``documents``,
``add_generation_prompt``, the named special tokens, extra kwargs such as ``enable_thinking``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment

from freetokend.engine.tokenizer import named_special_tokens, read_json

# Names a message's reasoning may come under; templates read ``reasoning_content``
# (gpt-oss templates read ``thinking``).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A template that is missing, does not compile, or fails while rendering."""


class NoChatTemplate(ChatTemplateError):
    """The model ships no chat template (a base model): it serves completions, not chats."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; for
    inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names (no path to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named self: namespace(self=1) must work
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _Dict:
    """``dict(...)`` for templates without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """A model's chat template(s): ``default`` plus named ones (e.g. ``tool_use``)."""

    def __init__(
        self, templates: Mapping[str, str], special_tokens: Mapping[str, str] | None = None
    ) -> None:
        if "default" not in templates and len(templates) != 1:
            raise ChatTemplateError(f"no default chat template among {sorted(templates)}")
        self.sources = dict(templates)
        self.special_tokens = dict(special_tokens or {})
        env = _environment()
        try:
            self._compiled = {name: env.from_string(src) for name, src in templates.items()}
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc

    @property
    def source(self) -> str:
        """The default template's text."""
        return self.sources.get("default") or next(iter(self.sources.values()))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate:
        """Templates from ``chat_template.jinja`` (+ ``additional_chat_templates/*.jinja``), else
        ``tokenizer_config.json["chat_template"]`` (a string, or a list of {name, template}),
        else ``chat_template.json``. Raises ChatTemplateError when the model has none."""
        model_dir = Path(model_dir)
        templates = _templates_in(model_dir)
        if not templates:
            raise NoChatTemplate(
                f"{model_dir} has no chat template (chat_template.jinja or "
                "tokenizer_config.json 'chat_template')"
            )
        return cls(templates, named_special_tokens(model_dir))

    def render(
        self,
        messages: Sequence[Mapping[str, Any] | msgspec.Struct],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text of ``messages``; ``template_kwargs`` reach the template as variables
        (they override the special tokens of the same name)."""
        template = self._pick(tools)
        try:
            chat = [_normalize_message(m) for m in messages]
            variables = {**self.special_tokens, **_plain(template_kwargs)}
        except RecursionError:  # untrusted values nested past the stack: a refusal, not a crash
            raise ChatTemplateError("chat messages or template variables nest too deeply") from None
        variables.pop("documents", None)
        try:
            return template.render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(template_kwargs.get("documents")),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as exc:  # template code is untrusted: any failure is a template error
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def _pick(self, tools: list[dict] | None) -> jinja2.Template:
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        return next(iter(self._compiled.values()))


def _templates_in(model_dir: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        out["default"] = jinja_file.read_text(encoding="utf-8")
        extra = model_dir / "additional_chat_templates"
        if extra.is_dir():
            for path in sorted(extra.glob("*.jinja")):
                out[path.stem] = path.read_text(encoding="utf-8")
        return out
    for source in (
        read_json(model_dir / "tokenizer_config.json").get("chat_template"),
        read_json(model_dir / "chat_template.json").get("chat_template"),
    ):
        if isinstance(source, str):
            return {"default": source}
        if isinstance(source, list):
            return {
                str(t["name"]): str(t["template"])
                for t in source
                if isinstance(t, Mapping) and "name" in t and "template" in t
            }
    return out


def _plain(value: Any) -> Any:
    """Mappings, sequences and msgspec Structs rebuilt as dicts and lists (templates see only
    plain data)."""
    if isinstance(value, msgspec.Struct):
        return _plain(msgspec.to_builtins(value))
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _normalize_message(message: Mapping[str, Any] | msgspec.Struct) -> dict[str, Any]:
    """Drop None-valued keys (APIs send content=None, templates expect the key absent) and
    expose reasoning under every name templates read, as transformers does."""
    if isinstance(message, msgspec.Struct):
        message = msgspec.to_builtins(message)
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"chat messages must be mappings, got {type(message).__name__}")
    out = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out
