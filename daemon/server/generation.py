"""One running generation, seen from an API route: text deltas, parsed events, usage.

Takes a request's StepOutputs from the bridge, turns ids into text (IncrementalDetokenizer),
applies the client's stop strings (StopChecker: on a hit the request is aborted in the
engine, freeing its KV, and finishes with ``stop``), feeds the text to the model's output
parser (content / reasoning / tool calls), and counts usage. The final stop/eos token is not
part of the text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.tokenizer import IncrementalDetokenizer, StopChecker
from .bridge import RequestHandle
from .errors import RequestFailed
from .parsers.base import OutputParser, ParsedEvent
from .protocols import SubmitBridge


@dataclass
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]]  # (id, text, logprob), best first


@dataclass
class Chunk:
    """What one batch of engine outputs added (any part may be empty)."""

    text: str = ""  # raw text after stop handling (the Completions API streams this)
    events: list[ParsedEvent] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Generation:
    def __init__(
        self,
        *,
        bridge: SubmitBridge,
        handle: RequestHandle,
        tokenizer: Any,
        parser: OutputParser,
        stop: list[str],
        stop_token_ids: set[int],
        skip_special_tokens: bool,
        want_logprobs: bool,
        metrics: Any,
        keep_special: frozenset[int] = frozenset(),
    ) -> None:
        """``keep_special``: special tokens written out although ``skip_special_tokens`` (the
        tags the parser reads)."""
        self.request_id = handle.request_id
        self._bridge = bridge
        self._handle = handle
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=skip_special_tokens, keep_special=keep_special
        )
        self._stops = StopChecker(stop)
        self._stop_ids = stop_token_ids
        self._parser = parser
        self._want_logprobs = want_logprobs
        self._metrics = metrics
        self.usage = Usage(prompt_tokens=handle.num_prompt_tokens)
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # the client stop string that ended it, if any
        self.text = ""  # all text produced so far
        self.created = int(time.time())
        self.ttft: float | None = None
        self._outputs: AsyncIterator[Any] | None = None
        self._first: Any = None  # the first engine output, taken by start()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    async def start(self) -> None:
        """Waits for the engine's first output: the prompt is then prefilled and ``usage``
        counts the prompt tokens it did not compute (what a stream announces first, e.g. the
        Messages API's ``message_start``). Engine errors are raised here."""
        if self._outputs is None:
            self._outputs = aiter(self._handle.outputs())
            out = await anext(self._outputs, None)
            if out is not None:
                self._first = out
                self.usage.prompt_tokens = out.num_prompt_tokens
                self.usage.cached_tokens = out.num_cached_tokens

    async def _all_outputs(self) -> AsyncIterator[Any]:
        if self._outputs is None:
            self._outputs = aiter(self._handle.outputs())
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for out in self._outputs:
            yield out

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Chunks until the generation ends; then ``finish_reason`` and ``usage`` are set."""
        async for out in self._all_outputs():
            chunk = self._on_output(out)
            if self.done:
                chunk.events.extend(self._parser.finish(self.finish_reason == "length"))
                self._finalize()
            if chunk.text or chunk.events or chunk.logprobs:
                yield chunk
            if self.done:
                return

    async def collect(self) -> tuple[str, list[ParsedEvent], list[TokenLogprob]]:
        """Run to the end; all text, parsed events and logprobs."""
        text, events, lps = [], [], []
        async for c in self.chunks():
            text.append(c.text)
            events.extend(c.events)
            lps.extend(c.logprobs)
        return "".join(text), events, lps

    def close(self) -> None:
        """Always called when the route is done (normally or not): an unfinished request is
        aborted so its KV pages are freed."""
        if self.done:
            self._bridge.release(self.request_id)
        else:
            self._bridge.abort(self.request_id)
            self.finish_reason = "abort"
            self._metrics.aborted += 1

    # --- per output --------------------------------------------------------------------------

    def _on_output(self, out: Any) -> Chunk:
        if getattr(out, "error", None):
            self._bridge.release(self.request_id)  # the engine already dropped it
            self.finish_reason = "error"
            raise RequestFailed(f"This request failed: {out.error}")
        chunk = Chunk()
        if self.ttft is None:
            self.ttft = time.monotonic() - self._handle.submitted_at
            self._metrics.record_ttft(self.ttft)
        self.usage.prompt_tokens = out.num_prompt_tokens
        self.usage.cached_tokens = out.num_cached_tokens
        no_token = out.token_id < 0  # a finish notice without a new token (engine NO_TOKEN)
        self.usage.completion_tokens += 0 if no_token else 1
        is_stop_token = no_token or (
            out.finished and out.finish_reason == "stop" and out.token_id in self._stop_ids
        )
        delta = "" if is_stop_token else self._detok.push(out.token_id)
        if out.finished:
            delta += self._detok.flush()
        text, stopped, matched = self._stops.feed(delta)
        if out.finished and not stopped:
            text += self._stops.flush()
        if self._want_logprobs and out.logprob is not None and not is_stop_token:
            chunk.logprobs.append(self._logprob(out))
        if stopped:
            self.stop_sequence = matched
            self.finish_reason = "stop"
            self._bridge.abort(self.request_id)  # no more tokens: free the KV now
        elif out.finished:
            self.finish_reason = out.finish_reason or "stop"
        chunk.text = text
        self.text += text
        if text:
            chunk.events.extend(self._parser.feed(text))
        return chunk

    def _logprob(self, out: Any) -> TokenLogprob:
        decode = self._tokenizer.decode
        top = [(tid, decode([tid]), lp) for tid, lp in (out.top_logprobs or [])]
        return TokenLogprob(out.token_id, decode([out.token_id]), float(out.logprob), top)

    def _finalize(self) -> None:
        self._metrics.record_usage(self.usage.prompt_tokens, self.usage.cached_tokens)
