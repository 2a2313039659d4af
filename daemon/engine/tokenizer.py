"""Tokenizer: the HF `tokenizers` backend plus the token ids the engine needs, and the streaming
helpers that turn generated ids into text (incremental detokenisation, stop strings).

Files read from a model directory (all but ``tokenizer.json`` optional):
    tokenizer.json          the backend (vocab, merges, pre-tokenizer, decoder, added tokens)
    tiktoken.model          the backend when there is no tokenizer.json (tiktoken_vocab.py)
    tokenizer_config.json   named special tokens (bos/eos/pad...), added_tokens_decoder
    special_tokens_map.json named special tokens, when tokenizer_config lacks them
    generation_config.json  eos_token_id (int or list), bos/pad ids
    config.json             eos/bos/pad ids (also under ``text_config`` for multimodal configs)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tokenizers

from .tiktoken_vocab import tokenizer_from_tiktoken

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or {} when the file is missing."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def named_special_tokens(model_dir: Path) -> dict[str, str]:
    """bos_token/eos_token/... strings: tokenizer_config.json first, then special_tokens_map.json."""
    tok_cfg = read_json(model_dir / "tokenizer_config.json")
    tok_map = read_json(model_dir / "special_tokens_map.json")
    out: dict[str, str] = {}
    for name in (*_NAMED_SPECIAL, "mask_token"):
        source = tok_cfg if name in tok_cfg else tok_map
        text = token_text(source.get(name))
        if text is not None:
            out[name] = text
    return out


def _ids(value: Any) -> list[int]:
    """An id field of a config: int, list of ints, or absent."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# texts this long are encoded with the GIL released (about 10-30 ms of work and more)
GIL_FREE_ENCODE_CHARS = 16_384


class Tokenizer:
    """Text <-> ids for one model, plus the ids of its special tokens."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self.added_tokens: dict[str, int] = {tok.content: i for i, tok in added.items()}
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in added.items() if tok.special
        )
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and resolve eos/bos/pad ids from the config files."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if path.is_file():
            backend = tokenizers.Tokenizer.from_file(str(path))
        elif (model_dir / "tiktoken.model").is_file():  # Kimi: a rank file, never its Python
            backend = tokenizer_from_tiktoken(model_dir)
        else:
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        _add_missing_added_tokens(backend, read_json(model_dir / "tokenizer_config.json"))
        named = named_special_tokens(model_dir)
        gen = read_json(model_dir / "generation_config.json")
        cfg = read_json(model_dir / "config.json")
        cfgs = [gen, cfg, cfg.get("text_config") or {}]

        def by_name(name: str) -> int | None:
            text = named.get(name)
            return backend.token_to_id(text) if text is not None else None

        def first_id(field: str) -> int | None:
            found = [i for c in cfgs for i in _ids(c.get(field))]
            return found[0] if found else None

        eos = {i for c in cfgs for i in _ids(c.get("eos_token_id"))}
        if (named_eos := by_name("eos_token")) is not None:
            eos.add(named_eos)
        # The tokenizer files decide bos when they name it (Qwen says null although config.json
        # has a bos id: nothing must be prepended); the config ids are a fallback.
        tok_files_name_bos = _names_field(model_dir, "bos_token")
        bos = by_name("bos_token") if tok_files_name_bos else first_id("bos_token_id")
        pad = by_name("pad_token")
        if pad is None:
            pad = first_id("pad_token_id")
        return cls(backend, eos_token_ids=eos, bos_token_id=bos, pad_token_id=pad)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; added tokens written in the text (e.g. <|im_start|>) match.

        A long text goes through ``encode_batch``: the same ids, but it releases the GIL while
        it works, where ``encode`` holds it throughout (seconds for a prompt of megabytes, in
        which the server's event loop, though the call runs on a worker thread, stood still)."""
        if len(text) < GIL_FREE_ENCODE_CHARS:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        (enc,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(enc.ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)


def _names_field(model_dir: Path, name: str) -> bool:
    """Whether tokenizer_config.json or special_tokens_map.json has the key ``name`` (even null)."""
    return any(
        name in read_json(model_dir / f)
        for f in ("tokenizer_config.json", "special_tokens_map.json")
    )


def _add_missing_added_tokens(backend: tokenizers.Tokenizer, tok_cfg: Mapping[str, Any]) -> None:
    """Add tokens that tokenizer_config's added_tokens_decoder lists but tokenizer.json lacks."""
    decoder = tok_cfg.get("added_tokens_decoder")
    if not isinstance(decoder, Mapping):
        return
    for spec in decoder.values():
        content = token_text(spec)
        if content is None or backend.token_to_id(content) is not None:
            continue
        token = tokenizers.AddedToken(content, special=bool(spec.get("special")), normalized=False)
        backend.add_tokens([token])


_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams text from ids one at a time, decoding only a small window per token.

    Keeps two offsets into the id list: text up to ``_read`` was emitted; ``_prefix`` marks
    where the last emitted chunk began. Decoding ``ids[_prefix:]`` and dropping the text of
    ``ids[_prefix:_read]`` gives the new text with the context that SentencePiece-style decoders
    need (they strip the leading space of the first token decoded). While the new text ends in
    U+FFFD the last token(s) end in the middle of a UTF-8 character (byte-level BPE or byte
    fallback), so nothing is emitted until the character completes. A model can also produce
    truly invalid bytes: after ``max_pending`` held tokens the replacement chars are emitted.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = False,
        max_pending: int = 8,
        keep_special: Iterable[int] = (),
    ) -> None:
        """``keep_special``: special tokens written out even when ``skip_special_tokens`` (the
        markers an output parser reads, e.g. a ``<tool_call>`` that a tokenizer marks special)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.max_pending = max_pending
        keep = frozenset(keep_special)
        # skipping with exceptions: these ids are dropped here and the rest decoded whole
        self._dropped: frozenset[int] | None = (
            frozenset(tokenizer.special_token_ids) - keep if skip_special_tokens and keep else None
        )
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        if self._dropped is not None:
            return self.tokenizer.decode([i for i in ids if i not in self._dropped])
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ('' while a char is incomplete)."""
        self._ids.append(int(token_id))
        pending = len(self._ids) - self._read
        return self._emit(force=pending >= self.max_pending)

    def flush(self) -> str:
        """Return whatever is held back (incomplete characters become U+FFFD)."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if full_text.endswith(_REPLACEMENT) and not force:
            return ""
        # Decoding is prefix-stable here (the window starts on a character boundary).
        new_text = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        # The ids before _prefix are no longer needed; drop them to keep memory flat.
        if self._prefix > 0:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return new_text


class StopChecker:
    """Applies stop strings to streamed text with OpenAI semantics (the stop is not emitted).

    ``feed`` returns ``(text_safe_to_emit, stopped, matched_stop)``. A suffix of the text that
    could be the beginning of a stop string is held back until it is resolved; ``flush`` returns
    it at the end of a generation that did not stop.
    """

    def __init__(self, stop: Iterable[str]) -> None:
        self.stops = tuple(s for s in stop if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool, str | None]:
        if self.stopped:
            return "", True, self.matched
        buf = self._held + delta
        if not self.stops:
            return buf, False, None
        hit = self._earliest_stop(buf)
        if hit is not None:
            pos, stop = hit
            self._held, self.stopped, self.matched = "", True, stop
            return buf[:pos], True, stop
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False, None

    push = feed  # alias: the same call under the detokenizer's verb

    def flush(self) -> str:
        """Release held-back text (call when generation ends without a stop)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _earliest_stop(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            pos = buf.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
