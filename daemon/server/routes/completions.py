"""POST /v1/completions: raw text completion (no chat template), prompt as text or token ids."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, post

from .. import sse
from ..chat import Sampling
from ..errors import APIError, InternalError, InvalidRequest, error_event
from ..generation import Generation, TokenLogprob
from ..openapi import body_operation
from ..protocols import Service
from ..schemas.openai import CompletionRequest
from ..state import server_state
from .common import decode_body, new_id, respond
from .openai_chat_out import token_name, usage_dict


def prompt_of(body: CompletionRequest, svc: Service) -> str | list[int]:
    """The prompt as text or ids, refused (400) before any tokenizing when it cannot fit:
    more ids than the context, or more characters than the context's worth of the longest
    token. Accepts a string, a list of ids, or a one-element batch of either."""
    prompt: Any = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        limit = svc.max_model_len * svc.max_token_chars
        if len(prompt) > limit:
            raise InvalidRequest(
                f"prompt has {len(prompt)} characters; this model's context "
                f"({svc.max_model_len} tokens) cannot hold more than {limit}",
                param="prompt",
            )
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if len(prompt) > svc.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(prompt)} tokens, more than the context ({svc.max_model_len})",
                param="prompt",
            )
        vocab = svc.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)
    raise InvalidRequest(
        "prompt must be a non-empty string or list of token ids (batches of more than one "
        "prompt are not supported)",
        param="prompt",
    )


def prompt_ids(prompt: str | list[int], svc: Service) -> tuple[list[int], str]:
    """(ids, text) of a checked prompt; worker-thread work (tokenizing megabytes takes a
    while and must not stall the event loop)."""
    if isinstance(prompt, str):
        return svc.tokenizer.encode(prompt), prompt
    return prompt, svc.tokenizer.decode(prompt)


def sampling_of(body: CompletionRequest) -> Sampling:
    if body.n != 1:
        raise InvalidRequest("n: only n=1 is supported", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return Sampling(
        max_tokens=body.max_tokens if body.max_tokens is not None else 16,  # the API's default
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs,
    )


def legacy_logprobs(lps: list[TokenLogprob], offset: int, as_ids: bool) -> dict[str, Any]:
    """The Completions API's logprobs: its top_logprobs map a token's name to its logprob, so
    tokens of the same text share one entry unless ``as_ids`` names them by id."""
    offsets, pos = [], offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.text)
    return {
        "tokens": [token_name(lp.token_id, lp.text, as_ids) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [
            {token_name(tid, text, as_ids): value for tid, text, value in lp.top} for lp in lps
        ],
        "text_offset": offsets,
    }


class CompletionOutput:
    def __init__(
        self, gen: Generation, model: str, echo: str, include_usage: bool, as_ids: bool = False
    ) -> None:
        self.gen, self.model, self.echo, self.include_usage = gen, model, echo, include_usage
        self.as_ids = as_ids
        self.id = new_id("cmpl-")

    def _obj(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.gen.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _reason(self) -> str:
        return "length" if self.gen.finish_reason == "length" else "stop"

    async def complete(self) -> dict[str, Any]:
        text, _, lps = await self.gen.collect()
        choice = {
            "index": 0,
            "text": self.echo + text,
            "logprobs": legacy_logprobs(lps, len(self.echo), self.as_ids) if lps else None,
            "finish_reason": self._reason(),
        }
        return self._obj([choice], usage=usage_dict(self.gen.usage))

    async def stream(self) -> AsyncIterator[bytes]:
        offset = 0
        if self.echo:
            yield sse.data(
                self._obj(
                    [{"index": 0, "text": self.echo, "logprobs": None, "finish_reason": None}]
                )
            )
            offset = len(self.echo)
        try:
            async for chunk in self.gen.chunks():
                lp = (
                    legacy_logprobs(chunk.logprobs, offset, self.as_ids) if chunk.logprobs else None
                )
                offset += len(chunk.text)
                choice = {"index": 0, "text": chunk.text, "logprobs": lp, "finish_reason": None}
                yield sse.data(self._obj([choice]))
        except APIError as e:
            yield sse.data(error_event(e, anthropic=False))
            return
        except Exception as e:
            yield sse.data(error_event(InternalError(f"generation failed: {e}"), anthropic=False))
            return
        yield sse.data(
            self._obj([{"index": 0, "text": "", "logprobs": None, "finish_reason": self._reason()}])
        )
        if self.include_usage:
            yield sse.data(self._obj([], usage=usage_dict(self.gen.usage)))
        yield sse.DONE


@post("/v1/completions", status_code=200, operation_class=body_operation(CompletionRequest))
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    started = time.monotonic()
    state = server_state(request)
    state.check_intake()
    body = await decode_body(request, CompletionRequest)
    svc = state.service
    svc.check_model(body.model)
    sampling = sampling_of(body)
    prompt = prompt_of(body, svc)
    with svc.admitted():
        ids, text = await asyncio.to_thread(prompt_ids, prompt, svc)
    gen = await svc.start_ids(ids, sampling)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    echo = text if body.echo else ""
    out = CompletionOutput(gen, svc.name, echo, include_usage, body.return_tokens_as_token_ids)

    return await respond(request, "completions", gen, out, started, body.stream)
