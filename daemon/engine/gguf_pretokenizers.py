"""The text split of byte-level BPE vocabularies by llama.cpp pre-tokenizer name
(``tokenizer.ggml.pre``), for the names transformers' GGUF tokenizer conversion does not know.

transformers splits text with GPT-2's regex for any name it lacks, silently; for DeepSeek-V3
(``deepseek-v3``: digit runs of at most three, CJK runs split off) or GLM-4.5 (``glm4``) that
gives other tokens than the model was trained on. This table holds each such name's split as
llama.cpp documents it in llama-vocab.cpp (the regexes applied in order, every match and every
gap its own piece; where llama.cpp rewrote a regex for its own engine, the tokenizer.json original
it records is used). Names whose split is GPT-2's need no entry. Any other name gets one warning.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_CHATGLM4 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_STARCODER = (r"\p{N}", _GPT2)
_BAILING = (
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_NORDIC = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

# Kimi-K2's split: tokenization_kimi.py's TikTokenTokenizer.pat_str, arm by arm. `&&`
# intersects character classes, which tiktoken's regex engine and the Oniguruma one of
# `tokenizers` read alike. Used for llama.cpp's "kimi-k2" files and for Kimi's rank file
# (tiktoken_vocab.py).
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PAT_STR = "|".join(
    (
        r"[\p{Han}]+",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTION}",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTION}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)

# tokenizer.ggml.pre -> the regexes llama.cpp splits with, in order
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "kimi-k2": (KIMI_PAT_STR,),
    "deepseek-v3": _DEEPSEEK3,
    "hunyuan-dense": _DEEPSEEK3,
    "deepseek-coder": (
        r"[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}",
    ),
    "glm4": (_CHATGLM4,),
    "chatglm-bpe": (_CHATGLM4,),
    "stablelm2": (_QWEN2,),
    "hunyuan": (_QWEN2,),
    "grok-2": (_QWEN2,),
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "command-r": _STARCODER,
    "smollm": _STARCODER,
    "codeshell": _STARCODER,
    "exaone": _STARCODER,
    "minerva-7b": _STARCODER,
    "falcon": (
        r"[\p{P}\$\+<=>\^~\|`]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        "[0-9][0-9][0-9]",
    ),
    "bailingmoe": (_BAILING,),
    "bailingmoe2": (_BAILING,),
    "llada-moe": (_BAILING,),
    "seed-coder": (_SEED_CODER,),
    "poro-chat": (_NORDIC,),
    "bloom": (_NORDIC,),
    "gpt3-finnish": (_NORDIC,),
    "viking": (_NORDIC, r"\p{N}"),
}
# The names transformers' GGUF tokenizer conversion splits by one regex of its own (as of 5.25,
# ``GGUF_PRE_TOKENIZER_SPLITS``; the same regexes as llama.cpp's tokenizer.json originals), so that
# ``gguf_tokenizer`` builds those byte-level vocabularies without importing transformers (seconds
# of a start-up). tests/test_gguf_pretokenizers.py checks this copy against the installed table;
# a name transformers adds later is not here, and its files convert through transformers.
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TRANSFORMERS_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano dbrx "
        "smaug-bpe".split(),
        _LLAMA3,
    ),
    "tekken": _TEKKEN,
    **dict.fromkeys("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez".split(), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys("gpt-4o llama4 kanana2 talkie minimax-m2".split(), _GPT4O),
}

# Names llama.cpp splits with GPT-2's regex: transformers' fallback is already right for them.
GPT2_SPLIT_NAMES = frozenset(
    "gpt-2 phi-2 jina-es jina-de gigachat jina-v1-en jina-v2-es jina-v2-de jina-v2-code "
    "roberta-bpe a.x-4.0 mellum mpt olmo jais trillion granite-docling exaone4".split()
)
_warned: set[str] = set()


def _transformers_splits() -> dict[str, Any]:
    try:
        # deferred: transformers (heavy, optional until a GGUF tokenizer is built)
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
        )
    except ImportError:  # an older transformers without the table: ours decides alone
        return {}
    return dict(GGUF_PRE_TOKENIZER_SPLITS)


def apply_pre_tokenizer(backend: Any, name: str | None, source: str) -> None:
    """Gives ``backend`` (a byte-level BPE ``tokenizers.Tokenizer`` converted by transformers)
    the split of pre-tokenizer ``name`` when transformers does not know it; warns once for a
    name neither knows."""
    # deferred: tokenizers (heavy, optional until a GGUF tokenizer is built)
    from tokenizers import Regex, pre_tokenizers

    if name in _transformers_splits() or name in GPT2_SPLIT_NAMES:
        return
    regexes = PRE_TOKENIZER_SPLITS.get(name or "")
    if regexes is None:
        if name not in _warned:
            _warned.add(name or "")
            log.warning(
                "%s: GGUF pre-tokenizer %r is not known (neither to transformers nor to our "
                "table): text is split with GPT-2's regex, which may differ from the model's",
                source,
                name,
            )
        return
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
