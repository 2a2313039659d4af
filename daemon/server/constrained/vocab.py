"""The model's vocabulary in the form xgrammar needs, read straight from ``tokenizer.json``.

xgrammar's own helper wants a ``transformers`` tokenizer; the daemon does not depend on
transformers, and ``tokenizer.json`` already has everything: the token strings by id (model
vocab plus added tokens) and, from its decoder, how those strings map to bytes
(GPT-2 byte-level, SentencePiece byte-fallback, or raw).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import xgrammar as xgr


def _vocab_type(tok: dict[str, Any]) -> tuple[xgr.VocabType, bool]:
    """(vocab type, add_prefix_space) from the decoder / pre-tokenizer description."""
    text = json.dumps(tok.get("decoder") or {}) + json.dumps(tok.get("pre_tokenizer") or {})
    if "ByteLevel" in text:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in text:
        return xgr.VocabType.BYTE_FALLBACK, "Metaspace" in text or "Prepend" in text
    return xgr.VocabType.RAW, False


def encoded_vocab(tok: dict[str, Any], vocab_size: int) -> list[str]:
    """Token strings indexed by id; ids with no token (padding) are empty strings."""
    out = [""] * vocab_size
    model_vocab = (tok.get("model") or {}).get("vocab") or {}
    if isinstance(model_vocab, list):  # Unigram: [[piece, score], ...]
        model_vocab = {piece: i for i, (piece, _score) in enumerate(model_vocab)}
    for piece, idx in model_vocab.items():
        if 0 <= idx < vocab_size:
            out[idx] = piece
    for added in tok.get("added_tokens") or []:
        idx = added.get("id", -1)
        if 0 <= idx < vocab_size:
            out[idx] = added.get("content", "")
    return out


def load_tokenizer_info(
    tokenizer_json: Path, vocab_size: int, stop_token_ids: list[int]
) -> xgr.TokenizerInfo:
    """``vocab_size`` is the model's logits width (may exceed the tokenizer's ids: padding)."""
    tok = json.loads(Path(tokenizer_json).read_text())
    ids = [a.get("id", -1) for a in tok.get("added_tokens") or []]
    model_vocab = (tok.get("model") or {}).get("vocab") or {}
    n = (
        len(model_vocab)
        if isinstance(model_vocab, list)
        else max(model_vocab.values(), default=-1) + 1
    )
    size = max([vocab_size, n, *(i + 1 for i in ids)])
    vtype, prefix_space = _vocab_type(tok)
    return xgr.TokenizerInfo(
        encoded_vocab(tok, size),
        vtype,
        vocab_size=size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=prefix_space,
    )
