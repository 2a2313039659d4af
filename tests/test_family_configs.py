"""How config.json of the GLM / MiniMax-M2 families is normalised, and their MTP layers skipped."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny

from freetokend.models.config import ConfigError
from freetokend.models.config_hf import from_dict
from freetokend.models.loader import CheckpointError, load_model

_BASE = dict(
    vocab_size=97,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=3,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=48,
)


def test_glm_defaults_to_half_rotary_and_no_output_bias():
    cfg = from_dict(
        {
            **_BASE,
            "architectures": ["Glm4MoeForCausalLM"],
            "n_routed_experts": 8,
            "n_shared_experts": 2,
            "attention_bias": True,
            "rope_theta": 10000.0,
            "first_k_dense_replace": 1,
            "n_group": 4,
            "topk_group": 2,
            "num_nextn_predict_layers": 1,
        }
    )
    assert cfg.rope.rotary_dim == 8  # GLM-4.5's config.json may omit partial_rotary_factor
    assert cfg.attention_bias and not cfg.o_proj_bias
    assert cfg.moe_layers == (False, True, True)
    assert cfg.shared_expert_intermediate_size == 64 and not cfg.shared_expert_gated
    assert (cfg.router_kind, cfg.n_group, cfg.topk_group) == ("sigmoid_group", 4, 2)
    assert cfg.num_mtp_layers == 1


def test_minimax_rotary_dim_and_ungrouped_sigmoid_router():
    cfg = from_dict(
        {
            **_BASE,
            "architectures": ["MiniMaxM2ForCausalLM"],
            "num_local_experts": 8,
            "rotary_dim": 4,
            "n_group": 4,  # ignored: MiniMax-M2 never groups
        }
    )
    assert cfg.rope.rotary_dim == 4 and cfg.qk_norm == "full"
    assert (cfg.router_kind, cfg.n_group, cfg.norm_topk_prob) == ("sigmoid_group", 1, True)


def test_glm_lite_dense_layers_from_mlp_layer_types():
    raw = {
        **_BASE,
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "n_routed_experts": 8,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 8,
        "v_head_dim": 10,
        "mlp_layer_types": ["sparse", "dense", "sparse"],
    }
    cfg = from_dict(raw)
    assert cfg.is_mla and cfg.moe_layers == (True, False, True)
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        from_dict({**raw, "mlp_layer_types": ["sparse"]})
    with pytest.raises(ConfigError, match="n_group"):
        from_dict({**raw, "n_group": 3})


def test_mtp_layers_are_skipped_with_one_log_line(tmp_path, caplog):
    make_tiny("glm4_moe", tmp_path, seed=1)  # 3 layers, num_nextn_predict_layers = 1
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    mtp = {
        "model.layers.3.eh_proj.weight": torch.randn(64, 128),
        "model.layers.3.enorm.weight": torch.randn(64),
        "model.layers.3.mlp.experts.0.up_proj.weight": torch.randn(32, 64),
    }
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="freetokend.models.loader"):
        load_model(tmp_path)
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and "skipped 3 tensors" in lines[0]
    # a layer beyond the MTP layers is still an error
    save_file({**tensors, "model.layers.4.enorm.weight": torch.randn(64)}, path)
    with pytest.raises(CheckpointError, match="layers.4.enorm"):
        load_model(tmp_path)


def _markup_tokenizer(model_dir, tokens: list[str]) -> None:
    """A word-level tokenizer.json whose added special tokens are the family's chat markup."""
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(40)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.add_special_tokens(tokens)
    tok.save(str(model_dir / "tokenizer.json"))


def test_glm_and_minimax_anchor_tokens_reach_the_snapshot_policy(tmp_path):
    from freetokend import LLM

    cases = {
        "glm4_moe": {
            "<|user|>": "end_of_turn",
            "<|observation|>": "end_of_turn",
            "</think>": "end_of_thinking",
            "<tool_call>": "tool_call_start",
            "</tool_call>": "tool_call_end",
            "<tool_response>": "tool_output_start",
            "</tool_response>": "tool_output_end",
        },
        "minimax_m2": {
            "[e~[": "end_of_turn",
            "</think>": "end_of_thinking",
            "<minimax:tool_call>": "tool_call_start",
            "</minimax:tool_call>": "tool_call_end",
        },
    }
    for family, want in cases.items():
        d = tmp_path / family
        make_tiny(family, d, seed=2)
        _markup_tokenizer(d, ["<think>", *want])  # <think> is not an anchor
        llm = LLM(d, max_model_len=64, kv_tokens=64)
        got = {
            llm.tokenizer.id_to_token(i): k for i, k in llm.engine.prefix.policy.anchor_ids.items()
        }
        assert got == want, family


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "glm4_moe_lite"])
def test_absent_fields_default_as_in_transformers(family):
    """config.json files that leave out rope_interleave, the router groups, the shared experts or
    the dense layers mean what transformers' config class assumes."""
    import transformers as tf

    arch, cls = {
        "deepseek_v3": ("DeepseekV3ForCausalLM", tf.DeepseekV3Config),
        "glm4_moe": ("Glm4MoeForCausalLM", tf.Glm4MoeConfig),
        "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", tf.Glm4MoeLiteConfig),
    }[family]
    raw: dict = {**_BASE, "num_hidden_layers": 5, "n_routed_experts": 16, "num_key_value_heads": 4}
    if family != "glm4_moe":
        raw.update(kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
    for explicit_null in ({}, {"q_lora_rank": None}) if family != "glm4_moe" else ({},):
        ours = from_dict({**raw, **explicit_null, "architectures": [arch]})
        hf = cls(**raw, **explicit_null)
        assert ours.rope.interleaved == bool(getattr(hf, "rope_interleave", False))
        assert (ours.n_group, ours.topk_group) == (hf.n_group, hf.topk_group)
        assert ours.routed_scaling_factor == hf.routed_scaling_factor
        assert ours.shared_expert_intermediate_size == 32 * hf.n_shared_experts
        assert ours.q_lora_rank == (getattr(hf, "q_lora_rank", 0) or 0)
        dense = getattr(hf, "mlp_layer_types", None) or [
            "dense" if i < hf.first_k_dense_replace else "sparse" for i in range(5)
        ]
        assert ours.moe_layers == tuple(k == "sparse" for k in dense)


def test_grouped_sigmoid_routers_stay_fp32_in_bf16_checkpoints(tmp_path):
    """transformers routes GLM / DeepSeek-V3 on fp32 inputs and weights even in bf16 models:
    rounding the router input to bf16 first moves near-tied experts."""
    _, hf = make_tiny("glm4_moe", tmp_path, seed=4, dtype=torch.bfloat16)
    model, _ = load_model(tmp_path)
    router = model.layers[1].mlp.router
    assert router.weight.dtype == torch.float32
    assert model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16
    x = torch.randn(5, 64) * 3
    want = x @ hf.model.layers[1].mlp.gate.weight.float().T
    assert torch.allclose(router(x), want, rtol=1e-6, atol=1e-5)
