"""The built-in model runs through our engine: split prefill/decode consistency, transformers
agreement (loose: the checkpoint is bf16), chat through the template and tokenizer."""

from __future__ import annotations

import pytest
import torch

from freetokend import LLM
from freetokend.engine.runner import Work


@pytest.fixture(scope="module")
def llm(builtin_model_dir):
    return LLM(builtin_model_dir, max_model_len=512, kv_tokens=2048)


@pytest.fixture(scope="module")
def llm32(builtin_model_dir):
    """The same checkpoint upcast to fp32: no bf16 rounding of activations to flip a route."""
    return LLM(builtin_model_dir, max_model_len=512, kv_tokens=2048, dtype="float32")


def _logits(llm: LLM, ids: list[int], split: list[int]) -> torch.Tensor:
    st = llm.runner.new_state()
    out, pos = [], 0
    try:
        for n in split:
            out.append(llm.runner.forward([Work(st, ids[pos : pos + n])]))
            pos += n
        return torch.cat(out)
    finally:
        llm.runner.release(st)


def test_exercises_experts_deltanet_and_attention(llm):
    cfg = llm.config
    assert cfg.family == "qwen3_5_moe"
    assert {"linear_attention", "full_attention"} <= set(cfg.layer_types)
    assert cfg.num_moe_layers == cfg.num_layers and cfg.shared_expert_intermediate_size > 0


def test_prefill_then_decode_equals_one_prefill(llm32):
    llm = llm32
    ids = llm.tokenizer.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n")
    whole = _logits(llm, ids, [len(ids)])[-1]
    split = _logits(llm, ids, [len(ids) - 5, 1, 1, 1, 1, 1])[-1]
    assert (whole - split).abs().max().item() < 1e-3


def test_agrees_with_transformers(llm32, builtin_model_dir):
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(builtin_model_dir, dtype=torch.float32).eval()
    ids = llm32.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = _logits(llm32, ids, [len(ids) - 4, 1, 1, 1, 1])
    assert (ours - ref[-5:]).abs().max().item() < 2e-4
    greedy = llm32.generate(ids, max_tokens=16, ignore_eos=True)
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16
        )
    assert greedy == hf_out[0, len(ids) :].tolist()


def test_chat_renders_generates_and_decodes(llm):
    text = llm.chat([{"role": "user", "content": "hello"}], max_tokens=12, ignore_eos=True)
    assert isinstance(text, str) and len(text) > 0
    seeded = [
        llm.chat([{"role": "user", "content": "hi"}], max_tokens=8, temperature=1.0, seed=s)
        for s in (1, 1)
    ]
    assert seeded[0] == seeded[1]
