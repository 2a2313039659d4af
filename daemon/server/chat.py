"""The API-neutral chat request every route translates into, and its checks.

Each API (OpenAI chat, Responses, Anthropic) maps its body onto :class:`ChatRequest`:
template-ready messages (OpenAI-style dicts, which is what HF chat templates expect), tools as
OpenAI function tools, a tool-choice policy, an output format and sampling knobs. The rest of
the server (rendering, constraints, generation, parsing) only sees this.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..engine.sampler import MAX_STOP_TOKEN_IDS, SEED_MAX, SEED_MIN, SamplingParams
from .errors import InvalidRequest
from .limits import MAX_JSON_DEPTH, check_stops, json_shape

ROLES = ("system", "user", "assistant", "tool")
# OpenAI allows [a-zA-Z0-9_-]{1,64}; agents also use dots and colons (MCP namespaces).
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass
class Sampling:
    """Sampling knobs as the client gave them (None = engine default)."""

    max_tokens: int | None  # None: the rest of the context
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n: the chosen token's + top n
    max_tokens_field: str = "max_tokens"  # the API's name for it, for error messages


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    sampling: Sampling
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: str = "auto"  # auto | none | required | function (then forced_tool is set)
    forced_tool: str | None = None
    parallel_tool_calls: bool = True
    output_format: str = "text"  # text | json_object | json_schema
    output_schema: dict[str, Any] | None = None
    thinking: bool | None = None  # None: the template's default

    @property
    def constrained(self) -> bool:
        return self.output_format != "text" or self.tool_choice in ("required", "function")


def check_role(role: str, where: str) -> str:
    """``developer`` is the Responses/o-series name of ``system``; others are 400."""
    if role == "developer":
        return "system"
    if role not in ROLES:
        raise InvalidRequest(
            f"{where}: unknown role {role!r} (expected one of: {', '.join(ROLES)}, developer)",
            param=where,
        )
    return role


def check_tool(name: str | None, parameters: Any, where: str) -> tuple[str, dict[str, Any]]:
    """A tool's name and parameter schema, or a 400 naming the field."""
    if not name or not _TOOL_NAME.match(name):
        raise InvalidRequest(
            f"{where}.name: tool names are 1-128 characters of letters, digits, _ . : -",
            param=f"{where}.name",
        )
    if parameters is None:
        return name, {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{where}: the parameter schema must be a JSON object", param=where)
    kind = parameters.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise InvalidRequest(
            f"{where}: the parameter schema must describe an object (type 'object'), "
            f"got type {kind!r}",
            param=where,
        )
    props = parameters.get("properties", {})
    if not isinstance(props, dict):
        raise InvalidRequest(f"{where}.properties must be an object", param=where)
    return name, parameters


def arguments_value(arguments: Any) -> Any:
    """Tool-call arguments for a template: a dict when they parse as a JSON object (XML
    templates iterate them), else the original string. JSON nested deeper than
    MAX_JSON_DEPTH is a 400 (the template would overflow the stack walking it)."""
    where = "tool_calls.function.arguments"
    if isinstance(arguments, dict):
        json_shape(arguments, where)
        return arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments or "{}")
        except RecursionError:
            raise InvalidRequest(
                f"{where}: JSON nested more than {MAX_JSON_DEPTH} levels deep", param=where
            ) from None
        except ValueError:
            return arguments
        if isinstance(value, dict):
            json_shape(value, where)
            return value
    return arguments


def assistant_tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments_value(arguments)},
    }


def check_sampling(
    s: Sampling, max_context: int, vocab_size: int, defaults: Mapping[str, Any]
) -> SamplingParams:
    """The request's limits, checked once at the edge: each error a 400 naming the field. Returns
    the engine's parameters (``defaults``, already in range, for the knobs the client omits),
    which go to the engine unchanged; it does not check them again. An omitted max_tokens is
    ``max_context`` here (the rest of an empty prompt's context): :func:`fit_context` resolves
    it, and checks the total, once the prompt's length is known."""

    def bad(name: str, why: str) -> InvalidRequest:
        return InvalidRequest(f"{name} {why}", param=name)

    field_ = s.max_tokens_field
    if s.max_tokens is not None and s.max_tokens < 1:
        raise bad(field_, f"must be at least 1, got {s.max_tokens}")
    if s.max_tokens is not None and s.max_tokens > max_context:
        raise bad(field_, f"is {s.max_tokens}, more than the context ({max_context})")
    if s.temperature is not None and not 0.0 <= s.temperature <= 2.0:
        raise bad("temperature", f"must be in [0, 2], got {s.temperature}")
    if s.top_p is not None and not 0.0 < s.top_p <= 1.0:
        raise bad("top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k is not None and s.top_k < -1:
        raise bad("top_k", f"must be -1, 0 (off) or positive, got {s.top_k}")
    if s.min_p is not None and not 0.0 <= s.min_p <= 1.0:
        raise bad("min_p", f"must be in [0, 1], got {s.min_p}")
    if s.seed is not None and not SEED_MIN <= s.seed <= SEED_MAX:
        raise bad("seed", f"out of range, got {s.seed!r}")
    if s.logprobs is not None and not 0 <= s.logprobs <= 20:
        raise bad("top_logprobs", f"must be in [0, 20], got {s.logprobs}")
    check_stops(s.stop)
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"takes at most {MAX_STOP_TOKEN_IDS} ids")
    if any(t < 0 for t in s.stop_token_ids):
        raise bad("stop_token_ids", "must be token ids >= 0")
    if any(t >= vocab_size for t in s.stop_token_ids):
        raise bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
    kw: dict[str, Any] = {
        **defaults,
        "max_tokens": s.max_tokens if s.max_tokens is not None else max_context,
        "stop_token_ids": frozenset(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "logprobs": s.logprobs,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        value = getattr(s, name)
        if value is not None:
            kw[name] = value
    # top_k: -1 = off = 0; above the vocabulary = the whole vocabulary = off
    if not 0 < kw.get("top_k", 0) <= vocab_size:
        kw["top_k"] = 0
    return SamplingParams(**kw)


def fit_context(
    params: SamplingParams, s: Sampling, n_prompt: int, max_context: int
) -> SamplingParams:
    """``params`` (from :func:`check_sampling`) with an omitted max_tokens resolved to the rest
    of the context (the request's ``Sampling`` keeps what the client sent); a 400 when the
    prompt and max_tokens do not fit the context together."""
    max_tokens = params.max_tokens if s.max_tokens is not None else max(1, max_context - n_prompt)
    if n_prompt + max_tokens > max_context:
        field_ = s.max_tokens_field
        raise InvalidRequest(
            f"This model's context is {max_context} tokens; the prompt has "
            f"{n_prompt} tokens and {field_} is {max_tokens} "
            f"({n_prompt + max_tokens} in all). Shorten the prompt or lower {field_}.",
            param=field_,
        )
    if max_tokens == params.max_tokens:
        return params
    return msgspec.structs.replace(params, max_tokens=max_tokens)
