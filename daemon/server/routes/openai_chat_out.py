"""Chat Completions output: the final object, or the chunk stream, from a Generation."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from .. import sse
from ..errors import APIError, InternalError, error_event
from ..generation import Generation, TokenLogprob, Usage
from ..parsers.base import Content, ParsedEvent, Reasoning, ToolCall
from .common import new_id


def usage_dict(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def token_name(token_id: int, text: str, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or "token_id:<id>" when the request set vLLM's
    ``return_tokens_as_token_ids``."""
    return f"token_id:{token_id}" if as_ids else text


def logprob_entry(lp: TokenLogprob, as_ids: bool = False) -> dict[str, Any]:
    def one(tid: int, text: str, value: float) -> dict[str, Any]:
        name = token_name(tid, text, as_ids)
        return {"token": name, "logprob": value, "bytes": list(text.encode("utf-8"))}

    entry = one(lp.token_id, lp.text, lp.logprob)
    entry["top_logprobs"] = [one(tid, text, value) for tid, text, value in lp.top]
    return entry


def finish_reason(gen: Generation, called_tools: bool) -> str:
    reason = gen.finish_reason or "stop"
    if reason == "stop" and called_tools:
        return "tool_calls"
    return "length" if reason == "length" else "stop"


class ChatOutput:
    def __init__(
        self, gen: Generation, model: str, include_usage: bool, as_ids: bool = False
    ) -> None:
        self.gen = gen
        self.as_ids = as_ids
        self.model = model
        self.include_usage = include_usage
        self.id = new_id("chatcmpl-")
        self.tool_calls = 0

    def _call(self, ev: ToolCall) -> dict[str, Any]:
        self.tool_calls += 1
        return {
            "index": ev.index,
            "id": ev.id or new_id("call_"),
            "type": "function",
            "function": {"name": ev.name, "arguments": ev.arguments},
        }

    # --- non-streaming -----------------------------------------------------------------------

    async def complete(self) -> dict[str, Any]:
        _, events, lps = await self.gen.collect()
        content = "".join(e.text for e in events if isinstance(e, Content))
        reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
        calls = [self._call(e) for e in events if isinstance(e, ToolCall)]
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": {"content": [logprob_entry(x, self.as_ids) for x in lps]} if lps else None,
            "finish_reason": finish_reason(self.gen, bool(calls)),
        }
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.gen.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_dict(self.gen.usage),
        }

    # --- streaming ---------------------------------------------------------------------------

    def _chunk(self, delta: dict[str, Any], reason: str | None = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": reason,
        }
        choice.update(extra)
        return sse.data(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.gen.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    def _delta(self, ev: ParsedEvent) -> dict[str, Any]:
        if isinstance(ev, Content):
            return {"content": ev.text}
        if isinstance(ev, Reasoning):
            return {"reasoning_content": ev.text}
        return {"tool_calls": [self._call(ev)]}

    async def stream(self) -> AsyncIterator[bytes]:
        yield self._chunk({"role": "assistant", "content": ""})
        try:
            async for chunk in self.gen.chunks():
                lps = [logprob_entry(x, self.as_ids) for x in chunk.logprobs]
                if not chunk.events and lps:
                    yield self._chunk({}, logprobs={"content": lps})
                for i, ev in enumerate(chunk.events):
                    first = {"content": lps} if lps and i == 0 else None
                    yield self._chunk(self._delta(ev), logprobs=first)
        except APIError as e:
            yield sse.data(error_event(e, anthropic=False))
            return
        except Exception as e:  # engine failure mid-stream: tell the client, end cleanly
            yield sse.data(error_event(InternalError(f"generation failed: {e}"), anthropic=False))
            return
        yield self._chunk({}, finish_reason(self.gen, self.tool_calls > 0))
        if self.include_usage:
            yield sse.data(
                {
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.gen.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage_dict(self.gen.usage),
                }
            )
        yield sse.DONE
