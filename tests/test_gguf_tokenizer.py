"""The tokenizer, special tokens and chat template of a GGUF file come from its metadata alone and
equal those of the HF tokenizer it was written from."""

from __future__ import annotations

import shutil

import pytest
from gguf_files import write_gguf
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.chat_template import ChatTemplate
from freetokend.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln — ça va? Ñandú, naïve café, Ærøskøbing.",
    "日本語のテキストと中文文本，한국어 텍스트도 있습니다。",
    "Привет, мир! Ελληνικά κείμενα. עברית ומילים. العربية مع الأرقام ١٢٣",
    "emoji 👋🏽🎉 and combining marks: e\u0301 a\u0308 नमस्ते दुनिया",
    'def f(x):\n    return {"a": [1, 2, 3]}  # 12345 tabs\tand  spaces\n\n',
    "<|im_start|>user\nhi<think>ok</think><|im_end|><tool_call>{}</tool_call>",
]


@pytest.fixture(scope="module")
def gguf_llm(builtin_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-tok")
    vocab = Tokenizer.from_dir(builtin_model_dir).vocab_size
    hf = make_tiny("qwen3_moe", d / "hf", seed=3, mlp_only_layers=[], vocab_size=vocab)[1]
    path = write_gguf("qwen3_moe", hf, d / "m.gguf", tokenizer=builtin_model_dir, pre="qwen35")
    shutil.rmtree(d / "hf")  # nothing may be read from a model folder
    return LLM(path, max_model_len=128, kv_tokens=512)


def test_encode_decode_equal_the_hf_tokenizer(gguf_llm, builtin_model_dir):
    ref = Tokenizer.from_dir(builtin_model_dir)
    tok = gguf_llm.tokenizer
    assert tok.vocab_size == ref.vocab_size
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )


def test_special_tokens_from_metadata(gguf_llm, builtin_model_dir):
    ref = Tokenizer.from_dir(builtin_model_dir)
    tok = gguf_llm.tokenizer
    im_end = ref.token_to_id("<|im_end|>")
    assert im_end in tok.eos_token_ids and im_end in gguf_llm.engine.eos
    assert tok.special_token_ids == ref.special_token_ids
    anchors = gguf_llm._anchor_ids()
    assert anchors and all(tok.id_to_token(i) is not None for i in anchors)


def test_chat_template_renders_the_same_prompt(gguf_llm, builtin_model_dir):
    ref = ChatTemplate.from_dir(builtin_model_dir)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Grüße! 日本語?"},
        {"role": "assistant", "content": "Hallo."},
        {"role": "user", "content": "More"},
    ]
    ours = gguf_llm.chat_template.render(messages, add_generation_prompt=True)
    assert ours == ref.render(messages, add_generation_prompt=True)
    assert "<|im_start|>assistant" in ours
    assert gguf_llm.chat([{"role": "user", "content": "hi"}], max_tokens=4) is not None
