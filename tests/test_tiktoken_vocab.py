"""Kimi's tokenizer (a tiktoken rank file plus a Python class we never run) loaded as a byte-level
BPE: a synthetic rank file in Kimi's layout (``tiktoken.model`` + ``tokenizer_config.json`` with
Kimi's special ids after the ranks) must give the ids of tiktoken itself, built from the same
ranks, split and special tokens, on text with special tokens, code, CJK, emoji, whitespace runs
and digits; ids decode back to the text. The ranks come from a small greedy pair-merging over a
mixed corpus (all 256 bytes first, in a shuffled order, then the most frequent pairs), plus a few
tokens no merge sequence reaches, which tiktoken only gives for a whole piece.

A real Kimi ``tiktoken.model`` is checked the same way when FT_KIMI_TOKENIZER_DIR names a folder
holding it and its tokenizer_config.json (opt-in: --runslow or FT_RUN_SLOW=1)."""

from __future__ import annotations

import base64
import json
import os
import random
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Regex, pre_tokenizers

from freetokend.engine.tiktoken_vocab import (
    KIMI_PAT_STR,
    KIMI_RESERVED_SPECIAL_TOKENS,
    read_ranks,
    tokenizer_from_tiktoken,
)
from freetokend.engine.tokenizer import Tokenizer
from freetokend.formats.errors import CheckpointError

tiktoken = pytest.importorskip("tiktoken")

# Kimi-K2's named special ids, as offsets from the number of ranks (163584 in the real file)
KIMI_SPECIAL_OFFSETS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<think>": 22,
    "</think>": 23,
    "[UNK]": 254,
    "[PAD]": 255,
}
KIMI_AUTO_MAP = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}

CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's what they'd've done; WE'LL SEE, I'm sure.\n"
    "def tokenize(text: str) -> list[int]:\n"
    '    """Split and merge."""\n'
    "    return [ranks[piece] for piece in pattern.findall(text) if piece]\n\n"
    "for (int i = 0; i < 1024; ++i) { total += values[i] * 31337; }\n"
    "SELECT name, COUNT(*) FROM users WHERE created_at > '2024-01-01' GROUP BY name;\n"
    "我们的模型支持中文、英文和代码。今天天气很好，我们去公园散步吧！人工智能正在改变世界。\n"
    "日本語のテキストとカタカナ、ひらがなも混ざっています。東京都は日本の首都です。\n"
    "한국어 문장도 조금 있습니다. Привет, мир! Ελληνικά κείμενα. naïve café résumé Ωmega µ\n"
    "Numbers: 3.14159 2718281828 1,000,000 0x1F 42nd 1st\t\ttabs   and    spaces\r\n"
    "emoji 🚀🦙 ✅ 😶‍🌫️ and CamelCaseIdentifiers like HTTPServerError or getHTTPResponse.\n"
)


def _pieces(text: str) -> list[bytes]:
    """The corpus cut by Kimi's split (training only: any ranks are a fair test)."""
    split = pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated")
    return [piece.encode() for piece, _ in split.pre_tokenize_str(text)]


def synthetic_ranks(n_merges: int = 420) -> dict[bytes, int]:
    """All 256 bytes (shuffled, so byte b is not rank b), then greedily the most frequent
    adjacent pair of the corpus (ties: the smallest bytes), then tokens no merge reaches."""
    order = list(range(256))
    random.Random(43).shuffle(order)
    ranks = {bytes([b]): i for i, b in enumerate(order)}
    words = Counter(tuple(bytes([b]) for b in piece) for piece in _pieces(CORPUS * 3))
    for _ in range(n_merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], [-x for x in kv[0][0] + kv[0][1]]))[0]
        merged = best[0] + best[1]
        if merged not in ranks:
            ranks[merged] = len(ranks)
        new_words: Counter[tuple[bytes, ...]] = Counter()
        for word, count in words.items():
            out: list[bytes] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    # whole-piece-only tokens: tiktoken gives them for a piece equal to them, never by merging
    for extra in ("Kimi", " Moonshot", "我们的模型", "\n\n\n", "    "):
        ranks.setdefault(extra.encode(), len(ranks))
    return ranks


def write_rank_file(path: Path, ranks: dict[bytes, int]) -> None:
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in ranks.items()]
    path.write_text("\n".join(lines) + "\n", encoding="ascii")


def kimi_config(n_ranks: int) -> dict:
    return {
        "auto_map": KIMI_AUTO_MAP,
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "added_tokens_decoder": {
            str(n_ranks + off): {
                "content": text,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for text, off in KIMI_SPECIAL_OFFSETS.items()
        },
    }


def all_specials(n_ranks: int) -> dict[str, int]:
    """Kimi's class: named ids as the config says, the other reserved ids as placeholders."""
    named = {n_ranks + off: text for text, off in KIMI_SPECIAL_OFFSETS.items()}
    return {
        named.get(i, f"<|reserved_token_{i}|>"): i
        for i in range(n_ranks, n_ranks + KIMI_RESERVED_SPECIAL_TOKENS)
    }


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("kimi")
    ranks = synthetic_ranks()
    write_rank_file(d / "tiktoken.model", ranks)
    (d / "tokenizer_config.json").write_text(json.dumps(kimi_config(len(ranks))))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": len(ranks) + 2}))
    (d / "tokenization_kimi.py").write_text("raise SystemExit('the checkpoint code ran')\n")
    return d


@pytest.fixture(scope="module")
def reference(kimi_dir: Path):
    ranks = read_ranks(kimi_dir / "tiktoken.model")
    return tiktoken.Encoding(
        name="kimi-synthetic",
        pat_str=KIMI_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens=all_specials(len(ranks)),
    )


SAMPLES = [
    "Hello, world! The quick brown fox.",
    "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>"
    "写一个函数<|im_end|><|im_assistant|>assistant<|im_middle|><think>好的</think>",
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "北京"}<|tool_call_end|><|tool_calls_section_end|>',
    "[BOS]text[EOS][EOT]<|reserved_token_{R}|>[PAD][UNK]<|im_end",
    'def f(x):\n    return {"a": [1, 2, 3]}  # tabs\tand  spaces\n\n\n    \n',
    "for (int i = 0; i < 1024; ++i) { total += values[i] * 31337; }\r\n",
    "我们的模型支持中文、英文和代码。中文English混合mixed文本123四五六",
    "日本語のテキスト カタカナ ひらがな 東京 한국어 텍스트 Привет мир",
    "🚀 (normal) 😶‍🌫️ ✅ 🦙🦙 ------======= ......!!!!!!??????",
    "1 12 123 1234 12345 1234567 3.14159 1,000,000 ١٢٣ ½ ²",
    "I've been told he's there, 'RE you sure? WE'LL see; I'M sure they'd've",
    "HTTPServerError getHTTPResponse CamelCase naïve café e\u0301 Ωmega µß",
    "   leading\t\t\ttrailing   \n\n\n\r\n\u3000\u00a0end  ",
    "Kimi Moonshot 我们的模型\n\n\n    Kimi",
    "",
]


def _samples(n_ranks: int) -> list[str]:
    return [s.replace("{R}", str(n_ranks + 5)) for s in SAMPLES]


def test_ids_match_tiktoken(kimi_dir: Path, reference) -> None:
    ours = tokenizer_from_tiktoken(kimi_dir)
    for text in _samples(reference.n_vocab - KIMI_RESERVED_SPECIAL_TOKENS):
        want = reference.encode(text, allowed_special="all")
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == want, text


def test_ids_match_tiktoken_on_shuffled_corpus(kimi_dir: Path, reference) -> None:
    """The corpus's lines and words shuffled and glued in new ways, specials between them."""
    ours = tokenizer_from_tiktoken(kimi_dir)
    rng = random.Random(7)
    words = CORPUS.replace("\n", " \n ").split(" ")
    specials = list(KIMI_SPECIAL_OFFSETS)
    for _ in range(40):
        parts = rng.choices(words, k=rng.randint(1, 30))
        glue = rng.choice(["", " ", "  ", "\n", "\t", rng.choice(specials)])
        text = glue.join(parts)
        assert ours.encode(text).ids == reference.encode(text, allowed_special="all"), text


def test_decode_round_trips(kimi_dir: Path, reference) -> None:
    ours = tokenizer_from_tiktoken(kimi_dir)
    for text in _samples(reference.n_vocab - KIMI_RESERVED_SPECIAL_TOKENS):
        ids = ours.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    # every single id decodes to tiktoken's bytes (specials to their text)
    for i in range(reference.n_vocab):
        token = ours.id_to_token(i)
        assert token is not None
        if i < reference.n_vocab - KIMI_RESERVED_SPECIAL_TOKENS:
            want = reference.decode_single_token_bytes(i).decode("utf-8", "replace")
            assert ours.decode([i]) == want


def test_vocabulary_and_special_ids(kimi_dir: Path, reference) -> None:
    ours = tokenizer_from_tiktoken(kimi_dir)
    n_ranks = reference.n_vocab - KIMI_RESERVED_SPECIAL_TOKENS
    assert ours.get_vocab_size(with_added_tokens=True) == reference.n_vocab
    added = ours.get_added_tokens_decoder()
    assert sorted(added) == list(range(n_ranks, reference.n_vocab))
    assert all(tok.special for tok in added.values())
    for text, off in KIMI_SPECIAL_OFFSETS.items():
        assert ours.token_to_id(text) == n_ranks + off
    assert added[n_ranks + 5].content == f"<|reserved_token_{n_ranks + 5}|>"
    # special tokens go when asked to skip them
    ids = ours.encode("<|im_user|>user<|im_middle|>hi<|im_end|>").ids
    assert ours.decode(ids, skip_special_tokens=True) == "userhi"


def test_tokenizer_from_dir_uses_the_rank_file(kimi_dir: Path, reference) -> None:
    """The engine's loader takes the rank file when there is no tokenizer.json; the
    checkpoint's Python (which would exit) is not run."""
    tok = Tokenizer.from_dir(kimi_dir)
    n_ranks = reference.n_vocab - KIMI_RESERVED_SPECIAL_TOKENS
    assert tok.vocab_size == reference.n_vocab
    assert tok.eos_token_ids == {n_ranks + 1, n_ranks + 2}  # [EOS] named, <|im_end|> generation
    assert tok.bos_token_id == n_ranks
    assert tok.pad_token_id == n_ranks + 255
    text = "<|im_user|>user<|im_middle|>写代码: x = 42<|im_end|>"
    assert tok.encode(text) == reference.encode(text, allowed_special="all")
    assert n_ranks + 2 in tok.special_token_ids


def test_non_special_added_token_keeps_its_flag(tmp_path: Path) -> None:
    ranks = synthetic_ranks(n_merges=20)
    write_rank_file(tmp_path / "tiktoken.model", ranks)
    cfg = kimi_config(len(ranks))
    cfg["added_tokens_decoder"][str(len(ranks) + 22)]["special"] = False  # <think>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = tokenizer_from_tiktoken(tmp_path)
    think = len(ranks) + 22
    assert not ours.get_added_tokens_decoder()[think].special
    ids = ours.encode("<think>x</think>").ids
    assert ids[0] == think
    assert ours.decode(ids, skip_special_tokens=True) == "<think>x"


# ---- refusals: a file not in tiktoken's layout, a class whose split we do not know --------------


def _folder(tmp_path: Path, rank_text: str, cfg: dict | None = None) -> Path:
    (tmp_path / "tiktoken.model").write_text(rank_text, encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg or {"auto_map": KIMI_AUTO_MAP}))
    return tmp_path


def _bytes_lines(skip: int | None = None) -> str:
    return "".join(
        f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256) if b != skip
    )


@pytest.mark.parametrize(
    ("rank_text", "message"),
    [
        ("", "holds no tokens"),
        (_bytes_lines() + "aGVsbG8=\n", "line 257: not a tiktoken rank file"),
        (_bytes_lines() + "aGVsbG8= 256 x\n", "line 257: not a tiktoken rank file"),
        (_bytes_lines() + "!!!! 256\n", "line 257: the token is not base64"),
        (_bytes_lines() + "aGVsbG8= -3\n", "line 257: the rank is not"),
        (_bytes_lines() + "aGVsbG8= 255\n", "line 257: rank 255 given to two tokens"),
        (_bytes_lines() + "AA== 256\n", "line 257: token b'\\x00' listed twice"),
        (_bytes_lines() + "aGVsbG8= 300\n", "rank 256 is missing"),
        (_bytes_lines(skip=7).replace(" 255\n", " 7\n"), "single byte(s) are not tokens"),
        ('{"model": {"type": "BPE"}}\n', "not a tiktoken rank file"),
    ],
)
def test_wrong_layout_is_refused_naming_the_file(
    tmp_path: Path, rank_text: str, message: str
) -> None:
    folder = _folder(tmp_path, rank_text)
    with pytest.raises(CheckpointError, match="tiktoken.model") as err:
        Tokenizer.from_dir(folder)
    assert message in str(err.value)


def test_unknown_tokenizer_class_is_refused(tmp_path: Path) -> None:
    cfg = {"auto_map": {"AutoTokenizer": ["tokenization_other.OtherTokenizer", None]}}
    folder = _folder(tmp_path, _bytes_lines(), cfg)
    with pytest.raises(CheckpointError, match="tokenizer class is not known"):
        tokenizer_from_tiktoken(folder)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer class is not known"):
        tokenizer_from_tiktoken(folder)


def test_added_token_among_the_ranks_is_refused(tmp_path: Path) -> None:
    cfg = {"auto_map": KIMI_AUTO_MAP, "added_tokens_decoder": {"100": {"content": "[BOS]"}}}
    folder = _folder(tmp_path, _bytes_lines(), cfg)
    with pytest.raises(CheckpointError, match="one of the 256 ranks"):
        tokenizer_from_tiktoken(folder)


def test_folder_without_any_tokenizer_still_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# ---- opt-in: a real Kimi tiktoken.model --------------------------------------------------------

REAL_DIR = os.environ.get("FT_KIMI_TOKENIZER_DIR", "")


@pytest.mark.slow
@pytest.mark.skipif(
    not (REAL_DIR and (Path(REAL_DIR) / "tiktoken.model").is_file()),
    reason="set FT_KIMI_TOKENIZER_DIR to a folder with Kimi's tiktoken.model and "
    "tokenizer_config.json (e.g. a Kimi-K2-Instruct or Kimi-K2.5 download)",
)
def test_real_kimi_rank_file_matches_tiktoken() -> None:
    from tiktoken.load import load_tiktoken_bpe

    folder = Path(REAL_DIR)
    ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"))
    assert read_ranks(folder / "tiktoken.model") == ranks
    cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    named = {int(k): v["content"] for k, v in cfg.get("added_tokens_decoder", {}).items()}
    n_ranks = len(ranks)
    end = max([n_ranks + KIMI_RESERVED_SPECIAL_TOKENS - 1, *named]) + 1
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_ranks, end)}
    reference = tiktoken.Encoding(
        name="kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials
    )
    tok = Tokenizer.from_dir(folder)
    assert tok.vocab_size == reference.n_vocab
    texts = [*_samples(n_ranks), CORPUS, CORPUS.upper(), CORPUS * 5]
    for text in texts:
        assert tok.encode(text) == reference.encode(text, allowed_special="all"), text[:80]
        assert tok.decode(tok.encode(text)) == text
    for name, token_id in specials.items():
        assert tok.token_to_id(name) == token_id


def test_a_model_folder_with_a_rank_file_serves_its_tokenizer(tmp_path: Path) -> None:
    """A checkpoint whose tokenizer is Kimi's rank file: the engine's tokenizer, its eos ids and
    the tokenizer.json constrained decoding reads (written once, converted) all come from it."""
    from tiny_models import make_tiny

    from freetokend.engine.llm import LLM
    from freetokend.server.constrained.vocab import load_tokenizer_info

    ranks = synthetic_ranks()
    n = len(ranks) + KIMI_RESERVED_SPECIAL_TOKENS
    folder, _ = make_tiny("qwen3_moe", tmp_path / "ckpt", vocab_size=n)
    write_rank_file(folder / "tiktoken.model", ranks)
    (folder / "tokenizer_config.json").write_text(json.dumps(kimi_config(len(ranks))))
    assert not (folder / "tokenizer.json").exists()
    llm = LLM(folder, moe_backend="cpu")
    eos = Tokenizer.from_dir(folder).token_to_id("[EOS]")
    assert eos is not None and eos in llm._eos_ids()
    written = llm.tokenizer_json
    assert written.is_file() and written.parent != folder
    text = "def f(x):\n    return x  # 你好 [EOS]"
    assert Tokenizer.from_dir(written.parent).encode(text) == llm.tokenizer.encode(text)
    info = load_tokenizer_info(written, n, [eos])
    assert info.vocab_size == n
