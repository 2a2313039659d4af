"""``<think>...</think>`` reasoning parser (Qwen3 / Qwen3.5 / Qwen3-Next, GLM, MiniMax-M2), and
the same for other tag pairs (Gemma-4's ``<|channel>thought ... <channel|>``).

Some templates open the think block in the prompt itself (the generation prompt ends with
``<think>\\n``), so the model's first tokens are already reasoning with no opening tag:
``start_in_reasoning`` says which case this request is in (the renderer checks the prompt).
"""

from __future__ import annotations

from .base import Content, ParsedEvent, Reasoning, partial_suffix

OPEN = "<think>"
CLOSE = "</think>"


class ThinkParser:
    """Splits text into Reasoning (inside think tags) and Content (outside)."""

    def __init__(
        self, start_in_reasoning: bool = False, open_tag: str = OPEN, close_tag: str = CLOSE
    ) -> None:
        self._open, self._close = open_tag, close_tag
        self._in_reasoning = start_in_reasoning
        self._buf = ""
        # strip the newlines templates put right after a tag
        self._strip_next = start_in_reasoning

    def feed(self, text: str) -> list[ParsedEvent]:
        self._buf += text
        out: list[ParsedEvent] = []
        while True:
            marker = self._close if self._in_reasoning else self._open
            pos = self._buf.find(marker)
            if pos < 0:
                break
            self._emit(self._buf[:pos], out)
            self._buf = self._buf[pos + len(marker) :]
            self._in_reasoning = not self._in_reasoning
            self._strip_next = True
        hold = partial_suffix(self._buf, (self._close if self._in_reasoning else self._open,))
        self._emit(self._buf[: len(self._buf) - hold], out)
        self._buf = self._buf[len(self._buf) - hold :]
        return out

    def finish(self, truncated: bool = False) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        self._emit(self._buf, out)
        self._buf = ""
        return out

    def _emit(self, text: str, out: list[ParsedEvent]) -> None:
        if self._strip_next:
            text = text.lstrip("\n")
            if not text:
                return
            self._strip_next = False
        if not text:
            return
        if self._in_reasoning:
            out.append(Reasoning(text))
        else:
            out.append(Content(text))
