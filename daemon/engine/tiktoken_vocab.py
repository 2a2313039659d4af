"""A tiktoken vocabulary as a ``tokenizers.Tokenizer``, read from the files alone: Kimi's
``tiktoken.model`` (Kimi-K2, K2.5, K2.6, Kimi-Linear, Moonlight), whose checkpoints ship a Python
tokenizer class (``tokenization_kimi.TikTokenTokenizer`` in ``auto_map``) that this module never
imports or runs.

The files:
    tiktoken.model          one ``base64(token bytes) rank`` line per token; the rank is the id,
                            ranks 0..n-1 each once, every single byte among the tokens
    tokenizer_config.json   ``added_tokens_decoder`` ({id: {"content", "special", ...}}) names
                            special ids; Kimi reserves 256 of them right after the ranks, the
                            unnamed ones called ``<|reserved_token_{id}|>``

How tiktoken encodes, and how that becomes a byte-level BPE:
    * the text is cut at special tokens (every one of them, ``allowed_special="all"``), the rest
      split by the class's ``pat_str`` (for Kimi: o200k's split with a ``[\\p{Han}]+`` arm first
      and Han taken out of the letter classes; llama.cpp's pre-tokenizer ``kimi-k2``);
    * a piece that is a token whole is that token; otherwise its bytes are merged, the adjacent
      pair whose concatenation is the lowest-ranked token first (the leftmost on a tie), until
      no adjacent pair makes a token.
  So every way to cut a token into two tokens is a merge, ranked by the token's rank, which is
  what transformers' ``TikTokenConverter`` writes too; ``ignore_merges`` gives the whole-piece
  rule. Bytes are spelled as GPT-2's byte-to-character table, the ``ByteLevel`` pre-tokenizer
  and decoder's alphabet.

Where the ids may still differ from Kimi's class: that class cuts a text into windows of 400,000
characters and runs of more than 25,000 whitespace or non-whitespace characters before encoding
(a guard against a tiktoken stack overflow); only such texts tokenize differently at the cuts.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from ..formats.errors import CheckpointError
from .gguf_pretokenizers import KIMI_PAT_STR

TIKTOKEN_FILE = "tiktoken.model"

# TikTokenTokenizer.num_reserved_special_tokens: the special ids that follow the ranks
KIMI_RESERVED_SPECIAL_TOKENS = 256
# the Python classes whose split we know, by their auto_map module (``module.Class``)
_KNOWN_CLASSES = {"tokenization_kimi.TikTokenTokenizer": KIMI_PAT_STR}


def has_tiktoken_vocab(model_dir: str | Path) -> bool:
    """Whether the folder's tokenizer is a tiktoken rank file (and no ``tokenizer.json``)."""
    model_dir = Path(model_dir)
    return (model_dir / TIKTOKEN_FILE).is_file() and not (model_dir / "tokenizer.json").is_file()


def byte_alphabet() -> list[str]:
    """The character byte ``b`` is spelled with in a byte-level BPE vocabulary (GPT-2's table):
    printable Latin-1 bytes stand for themselves, the others (controls, space, DEL, NBSP, soft
    hyphen) take the characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out: list[str] = []
    shifted = 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + shifted))
            shifted += 1
    return out


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """The ``{token bytes: rank}`` of a tiktoken rank file; CheckpointError naming the file and
    line when the layout is not tiktoken's (``base64 rank`` lines, ranks 0..n-1 each once, all
    256 single bytes present)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the tiktoken rank file ({e})") from None
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        where = f"{path}, line {number}"
        if len(fields) != 2:
            raise CheckpointError(
                f"{where}: not a tiktoken rank file (a line holds 'base64-token rank', "
                f"this one has {len(fields)} field(s))"
            )
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            raise CheckpointError(f"{where}: the token is not base64") from None
        if not fields[1].isdigit():
            raise CheckpointError(f"{where}: the rank is not a non-negative integer")
        rank = int(fields[1])
        if not token:
            raise CheckpointError(f"{where}: an empty token")
        if token in ranks:
            raise CheckpointError(f"{where}: token {token!r} listed twice")
        if rank in seen_ranks:
            raise CheckpointError(f"{where}: rank {rank} given to two tokens")
        ranks[token] = rank
        seen_ranks.add(rank)
    if not ranks:
        raise CheckpointError(f"{path}: the tiktoken rank file holds no tokens")
    if max(seen_ranks) != len(ranks) - 1:
        missing = min(set(range(len(ranks))) - seen_ranks)
        raise CheckpointError(
            f"{path}: the ranks are not 0..{len(ranks) - 1} (rank {missing} is missing); "
            "they are the token ids"
        )
    lacking = [b for b in range(256) if bytes([b]) not in ranks]
    if lacking:
        raise CheckpointError(
            f"{path}: {len(lacking)} single byte(s) are not tokens (e.g. 0x{lacking[0]:02x}); "
            "a tiktoken vocabulary must cover every byte"
        )
    return ranks


def bpe_from_ranks(ranks: Mapping[bytes, int]) -> models.BPE:
    """The byte-level BPE model that encodes as tiktoken does with ``ranks``: vocabulary
    ``{spelled token: rank}``, one merge per way of cutting a token into two tokens, ordered by
    the token's rank (then the left part's, then the right part's), whole tokens kept whole."""
    alphabet = byte_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    keyed: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_rank, right_rank = ranks.get(left), ranks.get(right)
            if left_rank is not None and right_rank is not None:
                keyed.append((rank, left_rank, right_rank, left, right))
    keyed.sort()
    merges = [(spell(left), spell(right)) for _, _, _, left, right in keyed]
    return models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True)


def split_pattern(model_dir: Path, tok_cfg: Mapping[str, Any]) -> str:
    """The split regex of the folder's tiktoken tokenizer, chosen by the Python class that
    ``tokenizer_config.json`` names (its ``auto_map``); CheckpointError for a class we do not
    know (its split is in its code, which we do not run)."""
    auto_map = tok_cfg.get("auto_map")
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, Mapping) else None
    names = [entry] if isinstance(entry, str) else entry if isinstance(entry, list) else []
    for name in names:
        if isinstance(name, str) and name.split("--")[-1] in _KNOWN_CLASSES:
            return _KNOWN_CLASSES[name.split("--")[-1]]
    raise CheckpointError(
        f"{model_dir / TIKTOKEN_FILE}: a tiktoken vocabulary whose tokenizer class is not known "
        f"(tokenizer_config.json auto_map AutoTokenizer: {entry!r}; known: "
        f"{', '.join(sorted(_KNOWN_CLASSES))}); its text split lives in the checkpoint's Python, "
        "which is not run"
    )


def special_tokens(
    tok_cfg: Mapping[str, Any], n_ranks: int, source: Path
) -> list[tokenizers.AddedToken]:
    """The special tokens after the ranks, in id order from ``n_ranks``: those
    ``added_tokens_decoder`` names (``special`` as it says, true when it does not say), the
    others of the 256 reserved ids as ``<|reserved_token_{id}|>``. CheckpointError for a named
    id among the ranks, or one name given two ids."""
    named: dict[int, tuple[str, bool]] = {}
    decoder = tok_cfg.get("added_tokens_decoder")
    for key, spec in decoder.items() if isinstance(decoder, Mapping) else ():
        content = spec.get("content") if isinstance(spec, Mapping) else spec
        if not isinstance(content, str) or not str(key).isdigit():
            raise CheckpointError(
                f"{source}: added_tokens_decoder entry {key!r} is not an id with a content"
            )
        token_id = int(key)
        if token_id < n_ranks:
            raise CheckpointError(
                f"{source}: added token {content!r} has id {token_id}, one of the "
                f"{n_ranks} ranks of {TIKTOKEN_FILE} (special ids follow the ranks)"
            )
        special = spec.get("special", True) if isinstance(spec, Mapping) else True
        named[token_id] = (content, bool(special))
    contents = [content for content, _ in named.values()]
    if len(set(contents)) != len(contents):
        twice = next(c for c in contents if contents.count(c) > 1)
        raise CheckpointError(f"{source}: added token {twice!r} has two ids")
    end = max([n_ranks + KIMI_RESERVED_SPECIAL_TOKENS - 1, *named]) + 1
    out = []
    for token_id in range(n_ranks, end):
        content, special = named.get(token_id, (f"<|reserved_token_{token_id}|>", True))
        out.append(tokenizers.AddedToken(content, special=special, normalized=False))
    return out


def tokenizer_from_tiktoken(model_dir: str | Path) -> tokenizers.Tokenizer:
    """The folder's ``tiktoken.model`` and ``tokenizer_config.json`` as a tokenizer that gives
    tiktoken's ids: byte-level BPE over the ranks, the class's split, the special tokens (matched
    in text, as the class encodes with every special allowed) with their ids."""
    model_dir = Path(model_dir)
    rank_file = model_dir / TIKTOKEN_FILE
    cfg_file = model_dir / "tokenizer_config.json"
    try:
        tok_cfg = json_object(cfg_file)
    except ValueError as e:
        raise CheckpointError(f"{cfg_file}: not a JSON object ({e})") from None
    pattern = split_pattern(model_dir, tok_cfg)
    ranks = read_ranks(rank_file)
    backend = tokenizers.Tokenizer(bpe_from_ranks(ranks))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    added = special_tokens(tok_cfg, len(ranks), cfg_file)
    backend.add_tokens(added)
    for offset, token in enumerate(added):  # ids are given in order: check they landed
        if backend.token_to_id(token.content) != len(ranks) + offset:
            raise CheckpointError(
                f"{cfg_file}: added token {token.content!r} is also a token of {TIKTOKEN_FILE}"
            )
    return backend


def json_object(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; {} when the file is missing; ValueError when it is no
    JSON object."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError("the top level is not an object")
    return data
