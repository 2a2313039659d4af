"""Responses API output: the response object, or its typed event stream.

The stream is the sequence the openai SDK (and Codex) parse: ``response.created``,
``response.in_progress``, then per output item ``output_item.added`` -> part added -> deltas
-> done events -> ``output_item.done``, and always a final ``response.completed`` carrying
``usage`` (Codex retries without it; OpenCode loops). A length-limited response still ends
with ``response.completed``, its status ``incomplete``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from .. import sse
from ..errors import APIError, InternalError
from ..generation import Generation
from ..parsers.base import Content, ParsedEvent, Reasoning, ToolCall
from ..schemas.responses import ResponsesRequest
from .common import new_id


class ResponsesOutput:
    def __init__(self, gen: Generation, model: str, body: ResponsesRequest) -> None:
        self.gen = gen
        self.model = model
        self.body = body
        self.id = new_id("resp_")
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []  # finished items
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the reasoning/message item being streamed
        self._open_text = ""

    # --- the response object -----------------------------------------------------------------

    def response(self, status: str) -> dict[str, Any]:
        b = self.body
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": list(self.output),
            "error": None,
            "incomplete_details": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "tool_choice": b.tool_choice if isinstance(b.tool_choice, str) else "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": b.metadata or {},
            "usage": None,
        }
        if status in ("completed", "incomplete"):
            u = self.gen.usage
            obj["usage"] = {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            }
        if status == "incomplete":
            obj["incomplete_details"] = {"reason": "max_output_tokens"}
        return obj

    def _status(self) -> str:
        return "incomplete" if self.gen.finish_reason == "length" else "completed"

    # --- items -------------------------------------------------------------------------------

    @staticmethod
    def _reasoning_item(text: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": new_id("rs_"),
            "summary": [{"type": "summary_text", "text": text}] if text else [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
        }

    @staticmethod
    def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "type": "message",
            "id": new_id("msg_"),
            "status": status,
            "role": "assistant",
            "content": content if status == "completed" else [],
        }

    @staticmethod
    def _call_item(ev: ToolCall, status: str = "completed") -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": new_id("fc_"),
            "call_id": ev.id or new_id("call_"),
            "name": ev.name,
            "arguments": "" if status == "in_progress" else ev.arguments,
            # a call cut by the token limit (partial arguments) is "incomplete"
            "status": "incomplete" if ev.partial and status == "completed" else status,
        }

    async def complete(self) -> dict[str, Any]:
        _, events, _ = await self.gen.collect()
        reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
        content = "".join(e.text for e in events if isinstance(e, Content))
        if reasoning:
            self.output.append(self._reasoning_item(reasoning))
        if content or not any(isinstance(e, ToolCall) for e in events):
            self.output.append(self._message_item(content))
        self.output.extend(self._call_item(e) for e in events if isinstance(e, ToolCall))
        return self.response(self._status())

    # --- streaming ---------------------------------------------------------------------------

    def _event(self, kind: str, **payload: Any) -> bytes:
        self._seq += 1
        return sse.event(kind, {"type": kind, "sequence_number": self._seq, **payload})

    def ping(self) -> bytes:
        """Keep-alive while the stream is silent (a long prefill): ``response.in_progress``
        again. Codex restarts its idle timer on events only, and SSE comments are not events."""
        return self._event("response.in_progress", response=self.response("in_progress"))

    def _open_item(self, kind: str) -> list[bytes]:
        index = len(self.output)
        self._open_text = ""
        if kind == "reasoning":
            item: dict[str, Any] = {"type": "reasoning", "id": new_id("rs_"), "summary": []}
            self._open = item
            summary = {"type": "summary_text", "text": ""}
            return [
                self._event("response.output_item.added", output_index=index, item=item),
                self._event(
                    "response.reasoning_summary_part.added",
                    item_id=item["id"],
                    output_index=index,
                    summary_index=0,
                    part=summary,
                ),
            ]
        item = self._message_item("", status="in_progress")
        self._open = item
        part: dict[str, Any] = {
            "type": "output_text",
            "text": "",
            "annotations": [],
            "logprobs": [],
        }
        return [
            self._event("response.output_item.added", output_index=index, item=item),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _delta(self, text: str) -> bytes:
        assert self._open is not None
        self._open_text += text
        index, item_id = len(self.output), self._open["id"]
        if self._open["type"] == "reasoning":
            return self._event(
                "response.reasoning_summary_text.delta",
                item_id=item_id,
                output_index=index,
                summary_index=0,
                delta=text,
            )
        return self._event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=index,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _close_item(self) -> list[bytes]:
        if self._open is None:
            return []
        item, text, index = self._open, self._open_text, len(self.output)
        self._open = None
        if item["type"] == "reasoning":
            done = {**self._reasoning_item(text), "id": item["id"]}
            part = {"type": "summary_text", "text": text}
            events = [
                self._event(
                    "response.reasoning_summary_text.done",
                    item_id=item["id"],
                    output_index=index,
                    summary_index=0,
                    text=text,
                ),
                self._event(
                    "response.reasoning_summary_part.done",
                    item_id=item["id"],
                    output_index=index,
                    summary_index=0,
                    part=part,
                ),
            ]
        else:
            done = {**self._message_item(text), "id": item["id"]}
            part = done["content"][0]
            events = [
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                ),
            ]
        self.output.append(done)
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        return events

    def _call_events(self, ev: ToolCall) -> list[bytes]:
        index = len(self.output)
        item = self._call_item(ev, status="in_progress")
        done = {**item, "arguments": ev.arguments}
        done["status"] = "incomplete" if ev.partial else "completed"
        self.output.append(done)
        return [
            self._event("response.output_item.added", output_index=index, item=item),
            self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=ev.arguments,
            ),
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=ev.name,
                arguments=ev.arguments,
            ),
            self._event("response.output_item.done", output_index=index, item=done),
        ]

    def _on_event(self, ev: ParsedEvent) -> list[bytes]:
        if isinstance(ev, ToolCall):
            return self._close_item() + self._call_events(ev)
        kind = "reasoning" if isinstance(ev, Reasoning) else "message"
        out: list[bytes] = []
        if self._open is None or self._open["type"] != kind:
            out += self._close_item() + self._open_item(kind)
        out.append(self._delta(ev.text))
        return out

    async def stream(self) -> AsyncIterator[bytes]:
        yield self._event("response.created", response=self.response("in_progress"))
        yield self._event("response.in_progress", response=self.response("in_progress"))
        try:
            async for chunk in self.gen.chunks():
                for ev in chunk.events:
                    for frame in self._on_event(ev):
                        yield frame
        except Exception as e:  # engine failure mid-stream: a typed failure event
            err = e if isinstance(e, APIError) else InternalError(f"generation failed: {e}")
            failed = self.response("failed")
            failed["error"] = {"code": "server_error", "message": err.message}
            yield self._event("response.failed", response=failed)
            return
        if not self.output and self._open is None:
            for frame in self._open_item("message"):  # always at least one message item
                yield frame
        for frame in self._close_item():
            yield frame
        yield self._event("response.completed", response=self.response(self._status()))
