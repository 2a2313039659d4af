"""``<think>...</think>`` reasoning parser (Qwen3 / Qwen3.5 / Qwen3-Next, GLM, MiniMax-M2), and
the same for other tag pairs (Gemma-4's ``<|channel>thought ... <channel|>``).

Some templates open the think block in the prompt itself (the generation prompt ends with
``<think>\\n``), so the model's first tokens are already reasoning with no opening tag:
``start_in_reasoning`` says which case this request is in (the renderer checks the prompt), and
``opened`` is what the prompt already wrote after its opening tag.

Reasoning is one block at the start of the output (after whitespace), as llama.cpp reads it:
once it has closed, or text came first, the tags are text (a tool call's argument may spell
them: an agent editing this very file).

The reasoning and content it returns are those that the model's chat template renders back into
exactly the generated text (a client sends them back unchanged, and every character that renders
differently breaks prefix reuse there): the separators the template itself writes around the
tags (:class:`Separators`) are dropped, exactly those and no other whitespace.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Content, ParsedEvent, Reasoning, partial_suffix

OPEN = "<think>"
CLOSE = "</think>"


@dataclass(frozen=True)
class Separators:
    """What the chat template writes around a reasoning block, besides the tags:
    ``after_open`` + reasoning + ``before_close`` + CLOSE + ``after_close`` + content. A
    separator the generated text has there is not part of the reasoning or content (None:
    every newline there is dropped, for templates whose spacing is not known exactly)."""

    after_open: str | None = "\n"
    before_close: str = "\n"
    after_close: str | None = "\n\n"


# Qwen3 / Qwen3.5 / Qwen3-Next and the built-in model's template:
# '<think>\n' + reasoning + '\n</think>\n\n' + content
QWEN = Separators()
# templates not checked: the newlines after a tag are dropped, none before one
LOOSE = Separators(None, "", None)
# templates that write nothing around the tags (Kimi-K2: '<think>' + reasoning + '</think>')
NONE = Separators("", "", "")


class ThinkParser:
    """Splits text into Reasoning (inside think tags) and Content (outside)."""

    def __init__(
        self,
        start_in_reasoning: bool = False,
        open_tag: str = OPEN,
        close_tag: str = CLOSE,
        *,
        separators: Separators = QWEN,
        opened: str = "",
        ends: tuple[str, ...] = (),
    ) -> None:
        """``ends``: markers that end the reasoning without its closing tag and begin the
        content (Kimi-K2 opens its tool calls inside an unclosed think block)."""
        self._open, self._close = open_tag, close_tag
        self._ends = ends
        self._seps = separators
        self._in_reasoning = start_in_reasoning
        self._over = False  # the reasoning block closed, or text came first: tags are text
        self._buf = ""
        # the separator still to drop at the start of the current stretch ("" none)
        self._lead: str | None = ""
        if start_in_reasoning:  # the part of the separator the prompt has not written
            after = separators.after_open
            if after is None:
                self._lead = None
            elif after.startswith(opened):
                self._lead = after[len(opened) :]
        self._close_markers = (close_tag, separators.before_close + close_tag, *ends)

    def feed(self, text: str) -> list[ParsedEvent]:
        self._buf += text
        out: list[ParsedEvent] = []
        while True:
            marker = self._close if self._in_reasoning else self._open
            pos = self._buf.find(marker)
            if not self._in_reasoning:
                cut = len(self._buf) - partial_suffix(self._buf, (self._open,))
                if self._over or self._buf[: pos if pos >= 0 else cut].strip():
                    self._over = True  # text first: the reasoning block can no longer open
                    break
                if pos < 0:  # whitespace so far: held until the opening tag or text decides
                    return out
                self._buf = self._buf[pos:]  # whitespace before the block is the template's
                pos = 0
            if self._in_reasoning and self._ends:
                early = [
                    p for m in self._ends if (p := self._buf.find(m)) >= 0 and (pos < 0 or p < pos)
                ]
                if early:
                    # the content begins without the closing tag: the marker stays in it
                    end = min(early)
                    self._emit(self._buf[:end], out)
                    self._buf, self._in_reasoning, self._lead = self._buf[end:], False, ""
                    self._over = True
                    continue
            if pos < 0:
                break
            before = self._buf[:pos]
            sep = self._seps.before_close
            if self._in_reasoning and sep and before.endswith(sep):
                before = before[: -len(sep)]
            self._emit(before, out)
            self._buf = self._buf[pos + len(marker) :]
            self._in_reasoning = not self._in_reasoning
            self._over = not self._in_reasoning
            self._lead = self._seps.after_open if self._in_reasoning else self._seps.after_close
        markers = self._close_markers if self._in_reasoning else () if self._over else (self._open,)
        hold = partial_suffix(self._buf, markers)
        self._emit(self._buf[: len(self._buf) - hold], out)
        self._buf = self._buf[len(self._buf) - hold :]
        return out

    def finish(self, truncated: bool = False) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        self._emit(self._buf, out)
        self._buf = ""
        return out

    def _emit(self, text: str, out: list[ParsedEvent]) -> None:
        if not text:
            return
        lead = self._lead
        if lead is None:  # every newline
            text = text.lstrip("\n")
            if not text:
                return
        elif lead:  # the separator, as far as the text has it
            n = 0
            while n < len(text) and n < len(lead) and text[n] == lead[n]:
                n += 1
            if n == len(text) and n < len(lead):
                self._lead = lead[n:]  # all of it separator so far: the rest may follow
                return
            text = text[n:]
        self._lead = ""
        if not text:
            return
        if self._in_reasoning:
            out.append(Reasoning(text))
        else:
            out.append(Content(text))
