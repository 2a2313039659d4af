"""Gemma-4 MoE beyond the shared family tests (tests/test_engine_families.py runs both tiny
configs against transformers): the multimodal wrapper served text-only, Google's config
spelling of the global layers' geometry, what we refuse, and its anchor tokens."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import hf_config, make_tiny, perturb

from freetokend import LLM
from freetokend.engine.runner import Work
from freetokend.models.config import ConfigError
from freetokend.models.config_hf import from_dict, read_config
from freetokend.models.model import build_model, kv_bytes_per_token

# The text part of google/gemma-4-26B-A4B-it's config.json, as Google spells it
# (global_head_dim / num_global_key_value_heads, no per_layer_config).
A4B_TEXT = {
    "model_type": "gemma4_text",
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "moe_intermediate_size": 704,
    "num_experts": 128,
    "top_k_experts": 8,
    "enable_moe_block": True,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 2,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0,
    "vocab_size": 262144,
    "rope_parameters": {
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "rope_type": "proportional",
        },
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "dtype": "bfloat16",
}


def _a4b(**text_over: object) -> dict:
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": {**A4B_TEXT, **text_over},
        "vision_config": {"model_type": "gemma4_vision"},
    }


def test_26b_a4b_config_and_kv_geometry() -> None:
    cfg = from_dict(_a4b())
    assert cfg.family == "gemma4" and cfg.weight_prefix == "model.language_model"
    assert cfg.top_k == 8 and cfg.num_moe_layers == 30 and cfg.activation == "gelu_tanh"
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17, 23, 29]  # five sliding layers, then a global one
    assert [cfg.layer_head_dim(i) for i in (0, 5)] == [256, 512]
    assert [cfg.layer_num_kv_heads(i) for i in (0, 5)] == [8, 2]
    assert cfg.rope.kind == "default" and cfg.rope.rotary_dim == 256
    assert cfg.rope_full is not None and cfg.rope_full.kind == "proportional"
    assert cfg.rope_full.rotary_dim == 512 and cfg.rope_full.proportion == 0.25
    assert cfg.tie_word_embeddings and cfg.final_logit_softcapping == 30.0
    with torch.device("meta"):
        model = build_model(cfg)
    shapes = model.kv_layer_shapes
    assert shapes is not None and len(shapes) == 30
    assert shapes[0] == (8, 256) and shapes[5] == (2, 512)
    # K and V per token: 25 sliding layers of 8 x 256 and 5 global of 2 x 512, bf16
    assert kv_bytes_per_token(model) == 2 * (25 * 8 * 256 + 5 * 2 * 512) * 2


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(enable_moe_block=False), "enable_moe_block"),
        (dict(hidden_activation="relu"), "hidden_activation"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (dict(num_kv_shared_layers=30), "num_kv_shared_layers"),
        (dict(num_global_key_value_heads=3), "KV head count"),
        (dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=9), "vocab_size_per"),
    ],
)
def test_configs_we_do_not_serve_are_named(over: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        from_dict(_a4b(**over))


def test_kv_shared_layers_read_an_earlier_layer_of_their_type() -> None:
    types = ["sliding_attention", "full_attention", "sliding_attention"] * 2
    cfg = from_dict(_a4b(num_hidden_layers=6, layer_types=types, num_kv_shared_layers=3))
    assert cfg.kv_source_layers == (0, 1, 2, 2, 1, 2)
    with torch.device("meta"):
        model = build_model(cfg)
    assert model.num_attention_layers == 3  # shared layers own no pool layer


def test_conditional_generation_served_text_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import transformers as tf

    torch.manual_seed(5)
    vision = tf.Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
    )
    text = hf_config("gemma4")
    hf = tf.Gemma4ForConditionalGeneration(
        tf.Gemma4Config(
            text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None
        )
    ).eval()
    perturb(hf, 6)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "Gemma4ForConditionalGeneration"
    ]
    llm = LLM(tmp_path, moe_backend="cpu", max_model_len=64, kv_tokens=256)
    ids = torch.randint(2, 97, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0, -1].float()
    st = llm.runner.new_state()
    llm.runner.reserve(st, len(ids))
    try:
        ours = llm.runner.forward([Work(st, ids)])[-1]
    finally:
        llm.runner.release(st)
    assert (ours - ref).abs().max().item() < 2e-4


def test_anchor_tokens_reach_the_snapshot_policy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models

    want = {
        "<turn|>": "end_of_turn",
        "<channel|>": "end_of_thinking",
        "<|tool_call>": "tool_call_start",
        "<tool_call|>": "tool_call_end",
        "<|tool_response>": "tool_output_start",
        "<tool_response|>": "tool_output_end",
    }
    make_tiny("gemma4", tmp_path, seed=2)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0"))
    tok.add_special_tokens(["<|turn>", "<|channel>", *want])  # openers are not anchors
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(tmp_path, max_model_len=64, kv_tokens=64)
    got = {llm.tokenizer.id_to_token(i): k for i, k in llm.engine.prefix.policy.anchor_ids.items()}
    assert got == want
    assert read_config(tmp_path).family == "gemma4"


def test_ftw_folder_serves_the_same_tokens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from freetokend.models.ftw_convert import convert

    src = tmp_path / "hf"
    make_tiny("gemma4:ple", src, seed=4)
    convert(src, tmp_path / "ftw")
    prompt = list(range(3, 21))
    kw = dict(moe_backend="cpu", max_model_len=64, kv_tokens=256)
    a = LLM(src, **kw).generate(prompt, max_tokens=8, ignore_eos=True)
    b = LLM(tmp_path / "ftw", **kw).generate(prompt, max_tokens=8, ignore_eos=True)
    assert a == b and len(a) == 8
