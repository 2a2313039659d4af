"""The benchmark checkpoint's tokenizer: a real HF byte-level BPE that llama.cpp's converter accepts.

Why GPT-2's: `convert_hf_to_gguf.py` identifies a BPE pre-tokenizer by encoding a fixed probe
text and hashing the resulting token IDS (`get_vocab_base_pre`); an unknown hash aborts the
conversion. Ids depend on the whole vocabulary, so no freshly trained small tokenizer can pass:
only a tokenizer that reproduces a listed model's ids does. The llama.cpp source distribution
ships GPT-2's vocabulary and merges (models/ggml-vocab-gpt-2.gguf, a test file); rebuilt as a
`tokenizers` BPE it encodes the probe to the hash the converter lists as "gpt-2". Its ids reach
50256, so the checkpoint's vocab is 50257.

Without the llama.cpp sources (llama.cpp not benchmarked) a tiny byte-level BPE is trained on the
fly instead; it only has to tokenize, its ids stay < 50257.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_SIZE = 50257  # GPT-2's; the model's vocab (lm_head rows) is this size either way
EOS = "<|endoftext|>"


def _write(tok: object, out_dir: Path, kind: str) -> None:
    """Writes tokenizer.json + tokenizer_config.json (what AutoTokenizer and our engine read)."""
    tok.save(str(out_dir / "tokenizer.json"))  # type: ignore[attr-defined]
    eos_id = tok.token_to_id(EOS)  # type: ignore[attr-defined]
    cfg = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": EOS,
        "eos_token": EOS,
        "unk_token": EOS,
        "add_bos_token": False,
        "add_prefix_space": False,
        "model_max_length": 4096,
        "added_tokens_decoder": {
            str(eos_id): {
                "content": EOS,
                "special": True,
                "normalized": False,
                "lstrip": False,
                "rstrip": False,
                "single_word": False,
            }
        },
        "ft_bench_tokenizer": kind,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def _byte_level(vocab: dict[str, int], merges: list[tuple[str, str]]) -> object:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    return tok


def gpt2_tokenizer(vocab_gguf: Path) -> object:
    """GPT-2's byte-level BPE rebuilt from llama.cpp's test vocabulary file."""
    try:
        import gguf  # type: ignore[import-not-found,import-untyped]
    except ImportError:  # the sources ship the package too: <src>/gguf-py beside <src>/models
        sys.path.insert(0, str(vocab_gguf.parent.parent / "gguf-py"))
        import gguf  # type: ignore[import-not-found,import-untyped,no-redef]

    reader = gguf.GGUFReader(str(vocab_gguf))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    if len(tokens) != VOCAB_SIZE or tokens[-1] != EOS:
        raise ValueError(f"{vocab_gguf}: not GPT-2's vocabulary ({len(tokens)} tokens)")
    return _byte_level({t: i for i, t in enumerate(tokens)}, merges)  # type: ignore[arg-type]


def trained_tokenizer(vocab_size: int = 1024) -> object:
    """A small byte-level BPE trained on a few lines (used when llama.cpp is not benchmarked)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    text = [
        "The quick brown fox jumps over the lazy dog. " * 4,
        "Mixture-of-experts models route every token to a few experts per layer.",
        "def decode(tokens):\n    return ''.join(vocab[t] for t in tokens)\n",
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    return tok


def write_tokenizer(out_dir: Path, vocab_gguf: Path | None) -> str:
    """Writes the tokenizer files into `out_dir`; returns which kind ("gpt2" or "trained")."""
    if vocab_gguf is not None and vocab_gguf.exists():
        _write(gpt2_tokenizer(vocab_gguf), out_dir, "gpt2")
        return "gpt2"
    _write(trained_tokenizer(), out_dir, "trained")
    return "trained"


def tokenizer_kind(model_dir: Path) -> str | None:
    """The kind written by `write_tokenizer`, or None when the folder has none."""
    path = model_dir / "tokenizer_config.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("ft_bench_tokenizer")
