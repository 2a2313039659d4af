"""The tokenizer and chat template of a GGUF file, from its metadata alone.

The vocabulary is converted by transformers' GGUF tokenizer conversion (a maintained converter:
byte-level BPE, sentencepiece, unigram; the split regex chosen by ``tokenizer.ggml.pre``); the
pre-tokenizer names it does not know get their split from ``gguf_pretokenizers``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..formats.gguf_file import split_files
from .chat_template import ChatTemplate, ChatTemplateError
from .gguf_pretokenizers import apply_pre_tokenizer
from .tokenizer import Tokenizer


def metadata_file(path: str | Path) -> Path:
    """The file holding the metadata of ``path``: itself, or for any part of a split set
    (``name-0000i-of-0000N.gguf``) the first part."""

    return split_files(path)[0]


def _gguf_tokenizer(path: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    # deferred: transformers (heavy, optional until a GGUF tokenizer is built)
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer

    path = metadata_file(path)
    try:
        return get_gguf_tokenizer(str(path))  # type: ignore[no-any-return]
    except KeyError as e:
        raise ValueError(f"{path}: the GGUF metadata has no tokenizer ({e} missing)") from None


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The Tokenizer a GGUF file (or any part of a split set) describes, with its eos/bos/pad
    ids from the metadata."""
    # deferred: transformers (heavy, optional until a GGUF tokenizer is built)
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    path = metadata_file(path)
    arch, tok, tok_cfg = _gguf_tokenizer(path)
    if "tokens" not in tok:
        raise ValueError(f"{path}: the GGUF metadata has no tokenizer.ggml.tokens")
    backend, _ = convert_gguf_tokenizer(arch, tok)
    if tok.get("tokenizer_type") == "gpt2":  # byte-level BPE: the split is the pre-tokenizer's
        apply_pre_tokenizer(backend, tok.get("pre_tokenizer_type"), str(path))
    eos = tok.get("eos_token_id")
    return Tokenizer(
        backend,
        eos_token_ids=[eos] if isinstance(eos, int) else [],
        bos_token_id=tok.get("bos_token_id") if tok_cfg.get("add_bos_token") else None,
        pad_token_id=tok.get("pad_token_id"),
    )


def chat_template_from_gguf(path: str | Path) -> ChatTemplate:
    """The ``tokenizer.chat_template`` of a GGUF file (or any part of a split set);
    ChatTemplateError when it has none."""
    path = metadata_file(path)
    _, _, cfg = _gguf_tokenizer(path)
    source = cfg.get("chat_template")
    if not isinstance(source, str):
        raise ChatTemplateError(f"{path} has no chat template (tokenizer.chat_template)")
    special = {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
    return ChatTemplate({"default": source}, special)


def gguf_tokenizer_files(path: str | Path, out: Path) -> list[Path]:
    """Writes the file's (or split set's) tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` (special
    tokens, chat template) into ``out``; returns their paths (FTW conversion of a GGUF)."""

    path = metadata_file(path)
    tok = tokenizer_from_gguf(path)
    _, _, cfg = _gguf_tokenizer(path)
    tok.backend.save(str(out / "tokenizer.json"))
    keep = {k: v for k, v in cfg.items() if isinstance(v, (str, bool)) or v is None}
    (out / "tokenizer_config.json").write_text(json.dumps(keep, indent=2), encoding="utf-8")
    return [out / "tokenizer.json", out / "tokenizer_config.json"]
