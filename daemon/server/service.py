"""The served model, as the routes use it: render, tokenize, constrain, submit.

Every API route builds a :class:`ChatRequest` (or prompt ids for /v1/completions) and calls
:meth:`ModelService.start_chat` / :meth:`start_ids`, which return a running
:class:`Generation`. Rendering and grammar compilation are CPU work and run in a worker
thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from ..engine.chat_template import NoChatTemplate
from ..engine.sampler import SamplingParams
from .bridge import Submission
from .chat import ChatRequest, Sampling, check_sampling, fit_context
from .errors import InvalidRequest, NotFound
from .generation import Generation
from .limits import check_chat
from .model_names import ModelNames
from .parsers.base import PassThrough
from .parsers.registry import (
    OutputSyntax,
    ReasoningSyntax,
    ToolSyntax,
    detect_syntax,
    make_output_parser,
    parser_markers,
    prompt_opened,
    prompt_opens_reasoning,
)
from .protocols import SubmitBridge
from .scripted import Script, ScriptedConstraint, assistant_message, common_prefix

log = logging.getLogger(__name__)


@dataclass
class Rendered:
    text: str
    ids: list[int]


def chat_template_of(llm: Any) -> Any | None:
    """The model's chat template; None where the model ships none (a base model, as llama.cpp and
    vLLM serve one): /v1/completions serves it, a chat request gets a 400 that says why."""
    try:
        return llm.chat_template
    except NoChatTemplate as e:
        log.warning("%s: chat requests will be refused; /v1/completions serves the model", e)
        return None


def template_source(llm: Any, template: Any) -> str:
    """The chat template's Jinja text (to see which tool syntax it instructs)."""
    if template is None:
        return ""
    sources = getattr(template, "sources", None)
    if isinstance(sources, dict):
        return "\n".join(str(v) for v in sources.values())
    model_dir = Path(llm.model_dir)
    for name in ("chat_template.jinja",):
        if (model_dir / name).is_file():
            return (model_dir / name).read_text(encoding="utf-8")
    try:
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: [{"name": ..., "template": ...}]
        return "\n".join(t.get("template", "") for t in tpl if isinstance(t, dict))
    return tpl if isinstance(tpl, str) else ""


def sampling_defaults(model_dir: Path) -> dict[str, Any]:
    """The model's recommended sampling (generation_config.json) for knobs a client omits;
    temperature 1.0 (the OpenAI and Anthropic default) when the model names none."""
    try:
        gen = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        gen = {}
    out: dict[str, Any] = {"temperature": 1.0}
    if not isinstance(gen, dict):
        return out
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float)):
        value = gen.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = kind(value)
    # checked here, once: a value the engine would refuse (NaN, a negative top_p) is dropped
    # for the engine's own default rather than refusing every request that omits the knob
    for name in list(out):
        try:
            SamplingParams(**{name: out[name]}).validate()
        except ValueError:
            del out[name]
    return out


def max_token_chars(tokenizer: Any) -> int:
    """The longest token's text (characters): a prompt longer than the context times this
    cannot fit, so it is refused before tokenizing. Byte-level and SentencePiece token
    strings are never shorter than the text they decode to."""
    backend = getattr(tokenizer, "backend", None)
    try:
        vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else {}
    except Exception:  # an exotic backend: no bound from the vocabulary
        vocab = {}
    return max((len(t) for t in vocab), default=0) or 1024


def parser_token_ids(tokenizer: Any, syntax: OutputSyntax) -> frozenset[int]:
    """The tokenizer's added tokens that spell a tag the output parser reads, or part of one:
    written out even where the tokenizer marks them special and special tokens are skipped (a
    ``<tool_call>`` skipped left a call's markup as plain content)."""
    added: dict[str, int] = getattr(tokenizer, "added_tokens", {})
    markers = parser_markers(syntax)
    # a token spelling part of a tag too (``<parameter`` of ``<parameter=``)
    return frozenset(i for text, i in added.items() if text and any(text in m for m in markers))


# Syntaxes whose parser reads special tokens from the text: harmony's <|channel|>, ..., and the
# ｜DSML｜ of DeepSeek's tool-call tags (a special token that skipping would delete).
_READS_SPECIAL = (ToolSyntax.HARMONY, ToolSyntax.DEEPSEEK_DSML, ToolSyntax.DEEPSEEK_DSML_V3_2)


def special_tokens_skipped(
    syntax: OutputSyntax, constrained: bool, parser_ids: frozenset[int]
) -> tuple[bool, frozenset[int]]:
    """Whether a chat generation's text skips special tokens, and those it writes out anyway.
    Harmony's and DSML's parsers read their special tokens from the text: none skipped.
    A grammar's output is all structure, every token of it text the parser reads (the final
    stop token is left out anyway): none skipped. Otherwise the parser's tags are kept."""
    if syntax.tools in _READS_SPECIAL or constrained:
        return False, frozenset()
    return True, parser_ids


class ModelService:
    def __init__(
        self, llm: Any, bridge: SubmitBridge, metrics: Any, names: ModelNames | None = None
    ) -> None:
        self.llm = llm
        self.names = names or ModelNames()
        self.name: str = llm.name
        self.bridge = bridge
        self.metrics = metrics
        self.tokenizer = llm.tokenizer
        self.template = chat_template_of(llm)
        self.syntax = detect_syntax(llm.config.family, template_source(llm, self.template))
        self.parser_token_ids = parser_token_ids(self.tokenizer, self.syntax)
        self.max_model_len: int = llm.engine.max_model_len
        self.vocab_size: int = llm.config.vocab_size
        self.max_token_chars = max_token_chars(self.tokenizer)
        self.eos_ids: set[int] = set(llm.engine.eos)
        self.defaults = sampling_defaults(Path(llm.model_dir))
        self._grammars: Any = None
        # test-only scripted replies (server/scripted.py): set by the control plane, never by
        # a serving setting
        self.script: Script | None = None
        self._preparing = 0  # requests being rendered/tokenized now (event-loop thread only)
        self._ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()

    # --- checks ------------------------------------------------------------------------------

    def check_model(self, name: str, serve_unknown: bool = True) -> None:
        """Accept the served name, an alias of it, or (unless strict, or not
        ``serve_unknown``) any unknown name."""
        target = self.names.canonical(name)
        if target == self.name:
            return
        if serve_unknown and not self.names.is_alias(name) and self.names.fallback(name, self.name):
            return
        raise NotFound(
            f"The model {target!r} does not exist; this daemon serves {self.name!r}.",
            param="model",
        )

    def new_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):08x}"

    # --- rendering ---------------------------------------------------------------------------

    def _template_args(self, req: ChatRequest) -> tuple[Any, dict[str, Any]]:
        kwargs: dict[str, Any] = {}
        thinking = False if req.constrained else req.thinking
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        tools = [t.as_openai() for t in req.tools] if req.tools else None
        return tools, kwargs

    def render(self, req: ChatRequest) -> Rendered:
        """Chat template -> text -> ids. Raises InvalidRequest for what the template refuses."""
        tools, kwargs = self._template_args(req)
        try:
            text = self._render_messages(req.messages, tools, kwargs)
        except (jinja2.TemplateError, ValueError) as e:  # ChatTemplateError is a ValueError
            raise InvalidRequest(f"The chat template cannot render these messages: {e}") from None
        except RecursionError:
            raise InvalidRequest(
                "The chat template cannot render these messages: they nest too deeply"
            ) from None
        return Rendered(text, self.tokenizer.encode(text))

    def _render_messages(
        self,
        messages: list[dict[str, Any]],
        tools: Any,
        kwargs: dict[str, Any],
        add_generation_prompt: bool = True,
    ) -> str:
        gen = add_generation_prompt
        if self.template is None:
            raise InvalidRequest(
                f"The model {self.name!r} has no chat template (a base model): send its prompt "
                "to /v1/completions, or serve a checkpoint that ships one."
            )
        try:
            return str(
                self.template.render(messages, tools=tools, add_generation_prompt=gen, **kwargs)
            )
        except (jinja2.TemplateError, ValueError):
            # Many templates refuse a system message after the first one (Claude Code sends
            # them mid-conversation). Retry with those as user turns before giving up.
            demoted = [
                {**m, "role": "user"} if i > 0 and m.get("role") == "system" else m
                for i, m in enumerate(messages)
            ]
            if demoted == messages:
                raise
            return str(
                self.template.render(demoted, tools=tools, add_generation_prompt=gen, **kwargs)
            )

    async def count_tokens(self, req: ChatRequest) -> int:
        """Admitted like a generation (429/529 when the daemon is full), same limits."""
        check_chat(req)
        with self.admitted():
            rendered = await asyncio.to_thread(self.render, req)
        return len(rendered.ids)

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Hold a place while a request is prepared off the loop: requests in flight plus
        those being prepared never exceed the bridge's capacity (429/529 beyond)."""
        self.bridge.check_capacity(self._preparing)
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1

    # --- constraints -------------------------------------------------------------------------

    def _grammar_factory(self) -> Any:
        if self._grammars is None:
            # deferred: xgrammar (constrained decoding, loaded on first use)
            from .constrained.constraint import GrammarFactory

            self._grammars = GrammarFactory(
                getattr(self.llm, "tokenizer_json", Path(self.llm.model_dir) / "tokenizer.json"),
                self.llm.config.vocab_size,
                sorted(self.eos_ids),
            )
        return self._grammars

    def constraint_for(self, req: ChatRequest) -> Any:
        """The grammar this request needs, or None. ValueError names what was refused."""
        if req.tool_choice in ("required", "function"):
            if self.syntax.tools is ToolSyntax.NONE:
                raise InvalidRequest(
                    "tool_choice: this model has no tool-call syntax", param="tool_choice"
                )
            tools = [t for t in req.tools if req.forced_tool in (None, t.name)]
            return self._grammar_factory().forced_tool_call(
                self.syntax.tools, [(t.name, t.parameters) for t in tools]
            )
        if req.output_format == "json_object":
            return self._grammar_factory().json_object()
        if req.output_format == "json_schema":
            return self._grammar_factory().json_schema(req.output_schema or {})
        return None

    # --- generation --------------------------------------------------------------------------

    async def start_chat(self, req: ChatRequest) -> tuple[Generation, Rendered]:
        # admission and the cheap limits before rendering, tokenizing and grammar compiling
        check_chat(req)
        with self.admitted():
            rendered, params, constraint = await asyncio.to_thread(self._prepare_chat, req)
        # a named tool_choice: the grammar allows that tool only, so a call cut before its name
        # is still a call of it
        named = req.forced_tool if req.tool_choice == "function" else None
        schemas = {t.name: t.parameters for t in req.tools if named in (None, t.name)}
        opens = self.syntax.reasoning is ReasoningSyntax.THINK and prompt_opens_reasoning(
            rendered.text
        )
        parser = make_output_parser(
            self.syntax,
            schemas,
            start_in_reasoning=opens,
            parse_tools=req.tool_choice != "none",
            reasoning=not req.constrained,
            opened=prompt_opened(rendered.text) if opens else "",
            padded=req.constrained,
        )
        skip = special_tokens_skipped(self.syntax, req.constrained, self.parser_token_ids)
        gen = self._submit(rendered.ids, params, constraint, parser, req.sampling, skip)
        if self.script is not None and isinstance(constraint, ScriptedConstraint):
            self.script.record(
                {
                    "request_id": gen.request_id,
                    "entry": constraint.entry,
                    "prompt_ids": rendered.ids,
                    "reply_ids": constraint.ids,
                }
            )
        return gen, rendered

    def _prepare_chat(self, req: ChatRequest) -> tuple[Rendered, SamplingParams, Any]:
        """Worker thread: check the limits, render, fit the context, compile the grammar."""
        params = self.check_limits(req.sampling)  # cheap field errors first
        rendered = self.render(req)
        params = fit_context(params, req.sampling, len(rendered.ids), self.max_model_len)
        if self.script is not None:
            return rendered, params, self.scripted_reply(req, rendered)
        try:
            constraint = self.constraint_for(req)
        except ValueError as e:
            raise InvalidRequest(str(e), param=_format_param(req)) from None
        return rendered, params, constraint

    def scripted_reply(self, req: ChatRequest, rendered: Rendered) -> ScriptedConstraint:
        """Test-only (server/scripted.py): the constraint that makes the engine write the
        script's reply, spelled as the chat template renders that assistant message after these
        messages; its tokens are those the next request's prompt will have there."""
        assert self.script is not None
        index, reply = self.script.choose(req.messages, bool(req.tools))
        tools, kwargs = self._template_args(req)
        try:
            base = self._render_messages(req.messages, tools, kwargs, add_generation_prompt=False)
            opened = rendered.text[len(base) :] if rendered.text.startswith(base) else None
            text = None
            for with_reasoning in (True, False):
                msg = assistant_message(reply, with_reasoning)
                turn = self._render_messages([*req.messages, msg], tools, kwargs, False)
                if opened is None or not turn.startswith(base):
                    continue
                body = turn[len(base) :]
                # what the generation prompt already wrote (the header, an opened <think>)
                k = common_prefix(opened, body)
                text = body[k:]
                if k == len(opened):
                    break
        except (jinja2.TemplateError, ValueError) as e:
            raise InvalidRequest(f"scripted replies: cannot render the reply: {e}") from None
        if text is None:
            raise InvalidRequest("scripted replies: the template renders history differently")
        n = len(rendered.ids)
        whole = self.tokenizer.encode(rendered.text + text)
        ids = whole[n:] if whole[:n] == rendered.ids else self.tokenizer.encode(text)
        end = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
        ids = ids[: end + 1] if end is not None else [*ids, min(self.eos_ids)]
        constraint = ScriptedConstraint(ids)
        constraint.entry = index
        return constraint

    async def start_ids(self, ids: list[int], sampling: Sampling) -> Generation:
        """Raw completion: no template, no parser (text is all content)."""
        params = fit_context(self.check_limits(sampling), sampling, len(ids), self.max_model_len)
        return self._submit(ids, params, None, PassThrough(), sampling)

    def check_limits(self, s: Sampling) -> SamplingParams:
        """The request's limits, checked once (:func:`check_sampling`): the engine takes the
        returned parameters without checking them again (``Submission.checked``)."""
        return check_sampling(s, self.max_model_len, self.vocab_size, self.defaults)

    def _submit(
        self,
        ids: list[int],
        params: SamplingParams,
        constraint: Any,
        parser: Any,
        s: Sampling,
        skip: tuple[bool, frozenset[int]] | None = None,
    ) -> Generation:
        """``skip``: (skip special tokens, those written out anyway); None: the syntax's
        default with no exceptions (raw completions)."""
        rid = self.new_id()
        handle = self.bridge.submit(Submission(rid, ids, params, constraint, checked=True))
        skip_special, keep = skip or special_tokens_skipped(self.syntax, False, frozenset())
        return Generation(
            bridge=self.bridge,
            handle=handle,
            tokenizer=self.tokenizer,
            parser=parser,
            stop=s.stop,
            stop_token_ids=self.eos_ids | set(s.stop_token_ids),
            skip_special_tokens=skip_special,
            keep_special=keep,
            want_logprobs=s.logprobs is not None,
            metrics=self.metrics,
        )


def _format_param(req: ChatRequest) -> str:
    if req.tool_choice in ("required", "function"):
        return "tools"
    return "response_format"
