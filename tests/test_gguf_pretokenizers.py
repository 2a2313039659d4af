"""GGUF pre-tokenizer names transformers' conversion does not know get their model's split from
our table: a tiny byte-level BPE tokenizer is trained (``tokenizers``, offline) with each table
entry's split, written into a GGUF the way llama.cpp's converter stores a vocabulary, read back
through transformers' conversion plus our table, and must encode a multilingual text (CJK, kana,
code, digit runs, emoji, contractions) exactly as the HF tokenizer does. DeepSeek-V3's and
GLM-4's HF splits are also written out here as their tokenizer.json files have them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import pytest
from gguf_files import write_tokenizer
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from freetokend.engine.gguf_pretokenizers import GPT2_SPLIT_NAMES, PRE_TOKENIZER_SPLITS
from freetokend.engine.gguf_tokenizer import tokenizer_from_gguf

TEXT = (
    "I've been 'told he's there, 'RE you sure? We'Ve a'lL 3 33 333 3333 33333 1234567 3.14\n"
    "我想在apple工作1314151天～ 日本語のテキスト カタカナ ひらがな 한국어 텍스트\n"
    'def f(x):\n    return {"a": [1, 2, 3]}  # tabs\tand  spaces\n\n'
    "🚀 (normal) 😶‍🌫️ ✅ 🦙🦙 ------======= нещо на Български ......!!!!!!?????? µß Ωmega\n"
)
CORPUS = [TEXT, TEXT.upper(), TEXT.lower(), " ".join(reversed(TEXT.split()))] * 4

# As the HF tokenizer.json files of DeepSeek-V3 and GLM-4 spell their splits.
HF_SPLITS = {
    "deepseek-v3": (
        "\\p{N}{1,3}",
        "[一-龥\u3040-ゟ゠-ヿ]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
        "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
    "glm4": (
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    # OLMoE: GPT-2's split, which transformers' fallback already gives
    "olmo": ("'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+",),
}


def _hf_tokenizer(regexes: tuple[str, ...], folder: Path) -> Tokenizer:
    """A tiny byte-level BPE tokenizer with this split, saved as an HF folder."""
    tok = Tokenizer(models.BPE())
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": "{{x}}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok


def _gguf(folder: Path, pre: str) -> Path:
    path = folder / "vocab.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    write_tokenizer(w, folder, pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


CASES = [(name, regexes) for name, regexes in PRE_TOKENIZER_SPLITS.items()]
CASES += [(f"{name}:hf", regexes) for name, regexes in HF_SPLITS.items()]


@pytest.mark.parametrize("name, regexes", CASES, ids=[c[0] for c in CASES])
def test_gguf_tokenizer_splits_like_the_hf_tokenizer(name, regexes, tmp_path):
    pre = name.removesuffix(":hf")
    ref = _hf_tokenizer(regexes, tmp_path / "hf")
    ours = tokenizer_from_gguf(_gguf(tmp_path / "hf", pre))
    want = ref.encode(TEXT, add_special_tokens=False).ids
    assert ours.encode(TEXT) == want, pre
    assert ours.decode(want) == TEXT


def test_without_the_table_deepseek_v3_would_split_like_gpt2(tmp_path):
    """The check above can fail: transformers' conversion alone gives other tokens."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    ref = _hf_tokenizer(HF_SPLITS["deepseek-v3"], tmp_path / "hf")
    arch, tok, _ = get_gguf_tokenizer(str(_gguf(tmp_path / "hf", "deepseek-v3")))
    plain, _ = convert_gguf_tokenizer(arch, tok)
    want = ref.encode(TEXT, add_special_tokens=False).ids
    assert plain.encode(TEXT, add_special_tokens=False).ids != want


def test_unknown_name_warns_once_naming_it(tmp_path, caplog):
    ref_dir = tmp_path / "hf"
    _hf_tokenizer(HF_SPLITS["olmo"], ref_dir)
    path = _gguf(ref_dir, "made-up-pre")
    with caplog.at_level(logging.WARNING, logger="freetokend.engine.gguf_pretokenizers"):
        tokenizer_from_gguf(path)
        tokenizer_from_gguf(path)
    hits = [r for r in caplog.records if "made-up-pre" in r.getMessage()]
    assert len(hits) == 1


def test_gpt2_names_and_table_do_not_overlap_transformers():
    """Entries are only for names transformers lacks (its own table wins where it has one)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert not set(PRE_TOKENIZER_SPLITS) & set(GGUF_PRE_TOKENIZER_SPLITS)
    assert not GPT2_SPLIT_NAMES & set(PRE_TOKENIZER_SPLITS)
