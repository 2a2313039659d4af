"""The tokenizer and chat template of a GGUF file, from its metadata alone.

Byte-level BPE vocabularies (``tokenizer.ggml.model`` = gpt2: Qwen, DeepSeek, GLM, GPT-OSS,
MiniMax, OLMoE) whose pre-tokenizer name is known are built here, straight with the
``tokenizers`` library, to the same tokenizer transformers' GGUF conversion makes (the same
``tokenizer.json``, tests/test_gguf_tokenizer.py checks it): no import of transformers (seconds of
a start-up), and of Python work over the vocabulary only what ``tokenizers`` takes (a dict of the
vocab, the merges as pairs); the characters outside the byte alphabet are found in one numpy
pass, and only the few tokens to respell or to add are looked at one by one. Every other vocabulary (sentencepiece, unigram, an unknown pre-tokenizer name, no merges)
is converted by transformers (a maintained converter; the split regex chosen by
``tokenizer.ggml.pre``), the names it does not know getting their split from
``gguf_pretokenizers``.

The metadata is a parsed header's (``gguf_file.read_header``): a caller that parsed the file
already passes it, so a load reads each header once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..formats.gguf_file import read_header, split_files
from .chat_template import ChatTemplate, NoChatTemplate
from .gguf_pretokenizers import (
    GPT2_SPLIT_NAMES,
    PRE_TOKENIZER_SPLITS,
    TRANSFORMERS_SPLITS,
    apply_pre_tokenizer,
)
from .tokenizer import Tokenizer

# tokenizer.<key> -> the name transformers' GGUF conversion gives it (its GGUF_TOKENIZER_MAPPING)
_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}
_CONFIG_KEYS = {
    "chat_template": "chat_template",
    "ggml.add_bos_token": "add_bos_token",
    "ggml.add_eos_token": "add_eos_token",
}
_SPECIAL = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's)
_GPT2_DEFAULT = "<|endoftext|>"  # transformers' GPT2Tokenizer adds it as unk/bos/eos


def metadata_file(path: str | Path) -> Path:
    """The file holding the metadata of ``path``: itself, or for any part of a split set
    (``name-0000i-of-0000N.gguf``) the first part."""

    return split_files(path)[0]


def tokenizer_fields(
    metadata: dict[str, Any], source: str = ""
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(architecture, tokenizer fields, tokenizer config) of GGUF metadata, under the names
    transformers' ``get_gguf_tokenizer`` gives them; ValueError when it has no tokenizer."""
    try:
        arch = metadata["general.architecture"]
        tok = {n: metadata[f"tokenizer.{k}"] for k, n in _TOKENIZER_KEYS.items()
               if f"tokenizer.{k}" in metadata}  # fmt: skip
        cfg = {n: metadata[f"tokenizer.{k}"] for k, n in _CONFIG_KEYS.items()
               if f"tokenizer.{k}" in metadata}  # fmt: skip
        if tok.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to these unless told
            cfg.setdefault("add_bos_token", True)
        elif tok.get("tokenizer_type") == "gemma4":  # the chat template writes <bos> itself
            cfg["add_bos_token"] = False
        for name, key in _SPECIAL.items():
            tid = metadata.get(f"tokenizer.ggml.{key}")
            cfg[name] = tok["tokens"][tid] if tid is not None else None
    except KeyError as e:
        raise ValueError(f"{source}: the GGUF metadata has no tokenizer ({e} missing)") from None
    return arch, tok, cfg


def _metadata(path: Path, metadata: dict[str, Any] | None) -> dict[str, Any]:
    return metadata if metadata is not None else read_header(path).metadata


def tokenizer_from_gguf(path: str | Path, metadata: dict[str, Any] | None = None) -> Tokenizer:
    """The Tokenizer a GGUF file (or any part of a split set) describes, with its eos/bos/pad
    ids from the metadata (``metadata``: the first file's, when the caller parsed it)."""
    path = metadata_file(path)
    arch, tok, tok_cfg = tokenizer_fields(_metadata(path, metadata), str(path))
    if "tokens" not in tok:
        raise ValueError(f"{path}: the GGUF metadata has no tokenizer.ggml.tokens")
    backend = _byte_level(tok) if _direct(tok) else _converted(arch, tok, str(path))
    eos = tok.get("eos_token_id")
    return Tokenizer(
        backend,
        eos_token_ids=[eos] if isinstance(eos, int) else [],
        bos_token_id=tok.get("bos_token_id") if tok_cfg.get("add_bos_token") else None,
        pad_token_id=tok.get("pad_token_id"),
    )


def _direct(tok: dict[str, Any]) -> bool:
    """Whether ``_byte_level`` builds this vocabulary: byte-level BPE with its merges and a
    pre-tokenizer name whose split is known here."""
    pre = tok.get("pre_tokenizer_type")
    known = pre in TRANSFORMERS_SPLITS or pre in PRE_TOKENIZER_SPLITS or pre in GPT2_SPLIT_NAMES
    return tok.get("tokenizer_type") == "gpt2" and "merges" in tok and known


def _converted(arch: str, tok: dict[str, Any], source: str) -> Any:
    """transformers' conversion, with our split for the pre-tokenizer names it does not know."""
    # deferred: transformers (heavy, optional until a GGUF tokenizer is built)
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    backend, _ = convert_gguf_tokenizer(arch, tok)
    if tok.get("tokenizer_type") == "gpt2":  # byte-level BPE: the split is the pre-tokenizer's
        apply_pre_tokenizer(backend, tok.get("pre_tokenizer_type"), source)
    return backend


def _byte_spelling() -> dict[int, str]:
    """Byte-level BPE's alphabet: byte -> the printable character spelling it (GPT-2's table:
    printable Latin-1 bytes spell themselves, the others count up from U+0100)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in keep]
    return {b: chr(b) for b in keep} | {b: chr(256 + n) for n, b in enumerate(rest)}


def _spelled(tokens: list[str]) -> list[str]:
    """The vocabulary in the byte alphabet: a token with a character outside it (a special
    token such as DeepSeek's, a mislabelled one) spelled byte by byte, as transformers does.
    The characters are checked all at once (one joined string); only the tokens holding an
    outside character are visited."""
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    joined = "".join(tokens)
    outside = set(joined) - alphabet
    if not outside:
        return tokens
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    starts = np.cumsum(lengths) - lengths
    chars = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32)
    hits = np.isin(chars, np.array([ord(c) for c in outside], dtype=np.uint32))
    which = np.unique(np.searchsorted(starts, np.flatnonzero(hits), side="right") - 1)
    out = list(tokens)
    for i in which.tolist():
        out[i] = "".join(spelling[b] for b in tokens[i].encode("utf-8"))
    return out


def _byte_level(tok: dict[str, Any]) -> Any:
    """transformers' GGUF byte-level BPE (GPT2Tokenizer over the file's vocab and merges, its
    control tokens special and its user-defined tokens added, the split of ``pre``), built
    with ``tokenizers`` alone."""
    # deferred: tokenizers (heavy, optional until a GGUF tokenizer is built)
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    tokens: list[str] = tok["tokens"]
    vocab = dict(zip(_spelled(tokens), range(len(tokens)), strict=True))  # later ids win
    merges = [tuple(m.split(" ")) for m in tok["merges"]]
    backend = Tokenizer(
        models.BPE(
            vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
            fuse_unk=False,
        )
    )  # fmt: skip
    pre = str(tok.get("pre_tokenizer_type"))
    regexes: tuple[str, ...] = PRE_TOKENIZER_SPLITS.get(pre, ())
    if pre in TRANSFORMERS_SPLITS:
        regexes = (TRANSFORMERS_SPLITS[pre],)
    if regexes:
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:  # GPT-2's split
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    backend.add_special_tokens([AddedToken(_GPT2_DEFAULT, normalized=False, special=True)])
    types = np.asarray(tok.get("token_type") or (), dtype=np.int64)
    alphabet = set(_byte_spelling().values())
    control = [tokens[i] for i in np.flatnonzero(types == _CONTROL).tolist()]
    control = [t for t in control if set(t) <= alphabet]  # others: llama.cpp mislabels
    if control:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [tokens[i] for i in np.flatnonzero(types == _USER_DEFINED).tolist()]
    user = [t for t in user if backend.token_to_id(t) is not None]  # in the vocab
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return backend


def chat_template_from_gguf(
    path: str | Path, metadata: dict[str, Any] | None = None
) -> ChatTemplate:
    """The ``tokenizer.chat_template`` of a GGUF file (or any part of a split set);
    NoChatTemplate when it has none."""
    path = metadata_file(path)
    _, _, cfg = tokenizer_fields(_metadata(path, metadata), str(path))
    source = cfg.get("chat_template")
    if not isinstance(source, str):
        raise NoChatTemplate(f"{path} has no chat template (tokenizer.chat_template)")
    special = {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
    return ChatTemplate({"default": source}, special)


def gguf_tokenizer_files(path: str | Path, out: Path) -> list[Path]:
    """Writes the file's (or split set's) tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` (special
    tokens, chat template) into ``out``; returns their paths (FTW conversion of a GGUF)."""

    path = metadata_file(path)
    metadata = read_header(path).metadata
    tok = tokenizer_from_gguf(path, metadata)
    _, _, cfg = tokenizer_fields(metadata, str(path))
    tok.backend.save(str(out / "tokenizer.json"))
    keep = {k: v for k, v in cfg.items() if isinstance(v, (str, bool)) or v is None}
    (out / "tokenizer_config.json").write_text(json.dumps(keep, indent=2), encoding="utf-8")
    return [out / "tokenizer.json", out / "tokenizer_config.json"]
