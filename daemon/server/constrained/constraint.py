"""Grammar-constrained decoding with xgrammar, behind the engine's ``Constraint`` protocol.

One :class:`GrammarFactory` per loaded model compiles grammars (JSON object, JSON schema,
forced tool call); each request gets its own :class:`GrammarConstraint` (a matcher holding
that request's grammar state). The engine thread calls ``fill_mask`` before sampling and
``accept`` after, for that request only.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import xgrammar as xgr

from ..parsers.registry import ToolSyntax
from .formats import forced_tool_call
from .vocab import load_tokenizer_info

T = TypeVar("T")

# Compiled grammars are cached by xgrammar; a stream of unique schemas would grow that cache
# without end, so it is capped (least recently used grammars are dropped).
CACHE_LIMIT_BYTES = 64 << 20
# A schema that takes longer than this to compile is refused (400). xgrammar cannot be
# interrupted, so the compile goes on in its worker; there are COMPILE_WORKERS of them, and a
# request waits at most COMPILE_TIMEOUT_S for one, so runaway compiles cost at most that.
COMPILE_TIMEOUT_S = 10.0
COMPILE_WORKERS = 2


def _reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:123: ...")."""
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)


class SurrogateBytes:
    """Bitmasks that bar the tokens spelling a UTF-16 surrogate (U+D800-U+DFFF) in UTF-8.

    xgrammar's string rules accept the three bytes ``ED A0-BF 80-BF`` as one character,
    though they are no valid UTF-8: the text decodes them as three U+FFFD, so a string the
    grammar held to ``maxLength`` came back longer (and not the characters generated).
    ``keep_always`` clears the bits of tokens holding ``ED A0-BF``; ``keep_after_ed`` those of
    tokens starting with ``A0-BF``, for the step after a token of ``ends_ed`` (ending in ``ED``).
    The masks are ANDed into xgrammar's own token bitmask ([1, ceil(V/32)] int32, bit j of word
    i allowing token 32i + j) before it is applied: no extra op on the logits. None: no such
    token.
    """

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        inside: list[int] = []
        self.ends_ed: set[int] = set()
        starts_high: list[int] = []
        for i, b in enumerate(decoded_vocab[:vocab_size]):
            if not b:
                continue
            if _SURROGATE.search(b):
                inside.append(i)
            if b[-1] == 0xED:
                self.ends_ed.add(i)
            if 0xA0 <= b[0] <= 0xBF:
                starts_high.append(i)
        words = (vocab_size + 31) // 32
        self.keep_always = _keep_mask(inside, words)
        self.keep_after_ed = _keep_mask(starts_high, words)


def _keep_mask(barred: list[int], words: int) -> torch.Tensor | None:
    """An xgrammar-layout bitmask with every bit set but those of ``barred``."""
    if not barred:
        return None
    keep = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
    ids = np.asarray(barred, dtype=np.int64)
    np.bitwise_and.at(keep, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
    return torch.from_numpy(keep.view(np.int32)).view(1, words)


_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


class GrammarConstraint:
    """Masks disallowed tokens to -inf; terminates once the grammar and a stop token are done."""

    def __init__(
        self, compiled: xgr.CompiledGrammar, vocab_size: int, surrogates: SurrogateBytes
    ) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V/32)] int32
        self._surrogates = surrogates
        self._after_ed = False  # the last token ended in byte ED
        self._dead = False

    def fill_mask(self, logits: torch.Tensor) -> None:
        """``logits``: [V'] for this request (V' may exceed the tokenizer's V: padding)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        sur = self._surrogates
        for keep in (sur.keep_always, sur.keep_after_ed if self._after_ed else None):
            if keep is not None:
                self._bitmask &= keep
        width = logits.shape[-1]
        n = min(width, self._vocab_size)
        view = logits.view(1, width)
        mask = self._bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(view, mask, vocab_size=n)
        if width > n:
            logits[n:] = float("-inf")

    def accept(self, token_id: int) -> None:
        self._after_ed = token_id in self._surrogates.ends_ed
        if not self._matcher.accept_token(token_id):
            # The sampler picked a masked token (should not happen); stop rather than loop.
            self._dead = True

    def is_terminated(self) -> bool:
        return self._dead or self._matcher.is_terminated()


class GrammarFactory:
    """Compiles grammars against one model's vocabulary (compiled grammars are cached)."""

    def __init__(
        self, tokenizer_json: Path, vocab_size: int, stop_token_ids: list[int], threads: int = 2
    ) -> None:
        self.info = load_tokenizer_info(tokenizer_json, vocab_size, stop_token_ids)
        self._surrogates = SurrogateBytes(self.info.decoded_vocab, self.info.vocab_size)
        self._compiler = xgr.GrammarCompiler(
            self.info, max_threads=threads, cache_limit_bytes=CACHE_LIMIT_BYTES
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_WORKERS, "grammar")
        self.timeout_s = COMPILE_TIMEOUT_S

    def _timed(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(*args)`` in a compile worker; ValueError when it takes over ``timeout_s``."""
        fut = self._pool.submit(fn, *args, **kw)
        try:
            return fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()  # still queued: never runs; running: finishes unobserved
            raise ValueError(
                f"the grammar did not compile within {self.timeout_s:g} s; simplify the schema"
            ) from None

    def _wrap(self, compiled: xgr.CompiledGrammar) -> GrammarConstraint:
        return GrammarConstraint(compiled, self.info.vocab_size, self._surrogates)

    def json_object(self) -> GrammarConstraint:
        return self._wrap(self._timed(self._compiler.compile_builtin_json_grammar))

    def json_schema(self, schema: dict[str, Any]) -> GrammarConstraint:
        """Raises ValueError when xgrammar cannot use the schema."""
        try:
            compiled = self._timed(
                self._compiler.compile_json_schema, json.dumps(schema), any_whitespace=False
            )
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:
            raise ValueError(f"unsupported JSON schema: {_reason(e)}") from None
        return self._wrap(compiled)

    def forced_tool_call(
        self, syntax: ToolSyntax, tools: list[tuple[str, dict[str, Any] | None]]
    ) -> GrammarConstraint:
        """One call to one of ``tools`` in the model's syntax; ValueError on a bad schema."""
        tag = forced_tool_call(syntax, tools)
        try:
            compiled = self._timed(self._compiler.compile_structural_tag, tag)
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:
            raise ValueError(f"cannot constrain this tool call: {_reason(e)}") from None
        return self._wrap(compiled)
