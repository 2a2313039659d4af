"""Messages API output: the message object, or the event stream Anthropic clients parse.

Stream: ``message_start`` once the prompt is prefilled (with ``usage``, cached prompt tokens
included: OpenCode fails without it), then per content
block ``content_block_start`` / ``content_block_delta``... / ``content_block_stop``, then
``message_delta`` (stop reason and the final usage, cached prompt tokens included) and
``message_stop``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from .. import sse
from ..errors import APIError, InternalError, error_event
from ..generation import Generation
from ..parsers.base import Content, ParsedEvent, Reasoning, ToolCall, arguments_object
from .common import new_id

# Thinking blocks are echoed back by clients; ours carry no cryptographic signature.
SIGNATURE = "freetoken"


def stop_reason(gen: Generation, called_tools: bool) -> str:
    if gen.finish_reason == "length":
        return "max_tokens"
    if gen.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if called_tools else "end_turn"


def usage(gen: Generation) -> dict[str, Any]:
    u = gen.usage
    return {
        # Anthropic counts cached prompt tokens apart from input_tokens
        "input_tokens": max(0, u.prompt_tokens - u.cached_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_use_block(ev: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": ev.id or new_id("toolu_"),
        "name": ev.name,
        "input": arguments_object(ev.arguments),
    }


class MessagesOutput:
    def __init__(self, gen: Generation, model: str) -> None:
        self.gen = gen
        self.model = model
        self.id = new_id("msg_")
        self._index = -1  # index of the last started block
        self._open: str | None = None  # "text" | "thinking" while a block streams
        self._calls = 0

    def _message(
        self, content: list[dict[str, Any]], reason: str | None, usage_: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": self.gen.stop_sequence if reason == "stop_sequence" else None,
            "usage": usage_,
        }

    async def complete(self) -> dict[str, Any]:
        _, events, _ = await self.gen.collect()
        content: list[dict[str, Any]] = []
        thinking = "".join(e.text for e in events if isinstance(e, Reasoning))
        text = "".join(e.text for e in events if isinstance(e, Content))
        calls = [tool_use_block(e) for e in events if isinstance(e, ToolCall)]
        if thinking:
            content.append({"type": "thinking", "thinking": thinking, "signature": SIGNATURE})
        if text or not calls:
            content.append({"type": "text", "text": text})
        content.extend(calls)
        return self._message(content, stop_reason(self.gen, bool(calls)), usage(self.gen))

    # --- streaming ---------------------------------------------------------------------------

    def _start(self, block: dict[str, Any]) -> bytes:
        self._index += 1
        return sse.event(
            "content_block_start",
            {"type": "content_block_start", "index": self._index, "content_block": block},
        )

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse.event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self._index, "delta": delta},
        )

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": SIGNATURE}))
        self._open = None
        out.append(
            sse.event("content_block_stop", {"type": "content_block_stop", "index": self._index})
        )
        return out

    def _on_event(self, ev: ParsedEvent) -> list[bytes]:
        if isinstance(ev, ToolCall):
            self._calls += 1
            block = tool_use_block(ev)
            return [
                *self._stop(),
                self._start({**block, "input": {}}),
                self._delta(
                    {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                ),
                sse.event(
                    "content_block_stop", {"type": "content_block_stop", "index": self._index}
                ),
            ]
        kind = "thinking" if isinstance(ev, Reasoning) else "text"
        out: list[bytes] = []
        if self._open != kind:
            out += self._stop()
            empty = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            out.append(self._start(empty))
            self._open = kind
        if kind == "thinking":
            out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
        else:
            out.append(self._delta({"type": "text_delta", "text": ev.text}))
        return out

    async def stream(self) -> AsyncIterator[bytes]:
        try:
            # message_start waits for the prefill, so its usage counts the cached prompt tokens
            # (Claude Code and OpenCode read input usage there); pings keep the stream alive.
            await self.gen.start()
            yield sse.event(
                "message_start",
                {"type": "message_start", "message": self._message([], None, usage(self.gen))},
            )
            async for chunk in self.gen.chunks():
                for ev in chunk.events:
                    for frame in self._on_event(ev):
                        yield frame
        except Exception as e:
            err = e if isinstance(e, APIError) else InternalError(f"generation failed: {e}")
            yield sse.event("error", error_event(err, anthropic=True))
            return
        for frame in self._stop():
            yield frame
        if self._index < 0:  # an empty answer still has one (empty) text block
            yield self._start({"type": "text", "text": ""})
            self._open = "text"
            for frame in self._stop():
                yield frame
        reason = stop_reason(self.gen, self._calls > 0)
        yield sse.event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": self.gen.stop_sequence},
                "usage": usage(self.gen),
            },
        )
        yield sse.event("message_stop", {"type": "message_stop"})
