"""Tiny random checkpoints of every family we serve, in the real HF format (written by transformers).

Weights are drawn with a raised initializer range, and norms and biases are perturbed, so router
decisions are not near ties and a wrong wiring shows in the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = (
    "qwen3_moe",
    "qwen3_5_moe",
    "qwen3_next",
    "gpt_oss",
    "mixtral",
    "olmoe",
    "deepseek_v3",
    "glm4_moe",
    "glm4_moe_lite",
    "minimax_m2",
    "gemma4",
    "deepseek_v32",
    "glm_moe_dsa",
    "deepseek_v4",
)

# Second configs of a family ("family:variant" -> overrides of its tiny config): the other side
# of each switch the first config sets (grouping, shared expert, qk norm, biases, top-k, ...).
VARIANTS: dict[str, dict[str, Any]] = {
    "glm4_moe:flat": dict(
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        n_shared_experts=0,
        first_k_dense_replace=0,
        use_qk_norm=False,
        attention_bias=False,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    ),
    "glm4_moe_lite:flat": dict(
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        n_shared_experts=0,
        mlp_layer_types=["sparse", "dense", "sparse"],
        rope_interleave=False,
        attention_bias=True,
    ),
    # DSA: ungrouped router, no shared expert, every layer sparse, biases, a smaller top-k over
    # wider index keys (top-5 and top-7 each meet a near tie within 1e-5 at the boundary)
    "deepseek_v32:flat": dict(
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        n_shared_experts=0,
        first_k_dense_replace=0,
        attention_bias=True,
        index_topk=6,
        index_head_dim=24,
    ),
    # two shared-indexer layers in a row, dense layers between sparse ones, another top-k
    "glm_moe_dsa:shared2": dict(
        num_hidden_layers=4,
        indexer_types=["full", "shared", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        index_topk=6,
        index_head_dim=12,
    ),
    "minimax_m2:k3": dict(num_experts_per_tok=3, rotary_dim=16, num_key_value_heads=4),
    # per-layer input embeddings, the last two layers sharing KV, separate V on global layers,
    # a wider sliding window, no softcap, tied embeddings, top-3
    "gemma4:ple": dict(
        num_hidden_layers=5,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        sliding_window=16,
        global_head_dim=24,
        num_global_key_value_heads=None,
        attention_k_eq_v=False,
        top_k_experts=3,
        final_logit_softcapping=None,
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        tie_word_embeddings=True,
    ),
}

_COMMON: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.08,
    tie_word_embeddings=False,
    eos_token_id=1,
    bos_token_id=0,
    pad_token_id=0,
)


def hf_config(family: str, **over: Any) -> Any:
    import transformers as tf

    if ":" in family:  # a variant: its family's config with the variant's overrides
        over = {**VARIANTS[family], **over}
        family = family.split(":")[0]
    c = dict(_COMMON)
    cls: Any
    if family == "qwen3_moe":
        c.update(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rope_theta=10000.0,
        )
        cls = tf.Qwen3MoeConfig
    elif family == "qwen3_5_moe":
        c.update(
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=24,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        )
        cls = tf.Qwen3_5MoeTextConfig
    elif family == "qwen3_next":
        c.update(
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=40,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[2],
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            norm_topk_prob=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        )
        cls = tf.Qwen3NextConfig
    elif family == "gpt_oss":
        c.update(
            num_hidden_layers=3,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        )
        cls = tf.GptOssConfig
    elif family == "deepseek_v3":
        c.update(
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=48,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            num_key_value_heads=4,
            rope_interleave=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        c.pop("head_dim")
        cls = tf.DeepseekV3Config
    elif family == "glm4_moe":
        c.update(
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=48,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
            attention_bias=True,
            num_nextn_predict_layers=1,
        )
        cls = tf.Glm4MoeConfig
    elif family == "glm4_moe_lite":
        c.update(
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=48,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.8,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            num_key_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        c.pop("head_dim")
        cls = tf.Glm4MoeLiteConfig
    elif family in ("deepseek_v32", "glm_moe_dsa"):
        # DSA: the index top-k below the tests' prompts (3 to 44 tokens), so selection matters;
        # 32 indexer heads keep the index scores free of ties at the top-k boundary (with 2, many
        # are exactly 0 and transformers' torch.topk breaks such ties differently with the row's
        # length; with 16, one query of the family tests scores 0 against every key):
        # tests/test_dsa.py checks both
        c.update(
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=48,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            num_key_value_heads=4,
            index_topk=8,
            index_head_dim=16,
            index_n_heads=32,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        c.pop("head_dim")
        if family == "glm_moe_dsa":
            c["indexer_types"] = ["full", "shared", "full"]
            cls = tf.GlmMoeDsaConfig
        else:
            cls = tf.DeepseekV32Config
    elif family == "minimax_m2":
        c.update(
            num_hidden_layers=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            rotary_dim=8,
            rope_theta=10000.0,
        )
        cls = tf.MiniMaxM2Config
    elif family == "gemma4":
        # 26B-A4B's shape in miniature: sliding layers of head dim 16 with 2 KV heads, global
        # layers of head dim 32 with 1 KV head and V = K, a window shorter than the prompts
        c.update(
            num_hidden_layers=4,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            sliding_window=8,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=32,
            intermediate_size=48,
            final_logit_softcapping=30.0,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=97,
        )
        cls = tf.Gemma4TextConfig
    elif family == "deepseek_v4":
        # every mechanism of V4 (tests/test_deepseek_v4_layers.py's config): sliding, CSA at
        # rate 4 and HCA at rate 8 layers, a hash-routed layer, 3 hyper-connection streams, a
        # window of 8, the indexer's top-3 of up to 10 entries with 16 heads (fewer heads tie
        # at exact zeros), clamps that bind
        c.update(
            num_key_value_heads=1,
            head_dim=32,
            partial_rotary_factor=0.25,
            q_lora_rank=24,
            num_hidden_layers=4,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            swiglu_limit=0.5,
            hc_mult=3,
            sliding_window=8,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=16,
            index_head_dim=16,
            index_topk=3,
            rope_theta=10000.0,
            compress_rope_theta=160000.0,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
            max_position_embeddings=128,
        )
        cls = tf.DeepseekV4Config
    elif family == "mixtral":
        c.update(
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            rope_theta=10000.0,
        )
        cls = tf.MixtralConfig
    elif family == "olmoe":
        c.update(
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            clip_qkv=3.0,
            rope_theta=10000.0,
        )
        c.pop("head_dim")
        cls = tf.OlmoeConfig
    else:
        raise ValueError(family)
    c.update(over)
    return cls(**c)


def hf_model_class(family: str) -> Any:
    import transformers as tf

    return {
        "qwen3_moe": tf.Qwen3MoeForCausalLM,
        "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM,
        "qwen3_next": tf.Qwen3NextForCausalLM,
        "gpt_oss": tf.GptOssForCausalLM,
        "mixtral": tf.MixtralForCausalLM,
        "deepseek_v3": tf.DeepseekV3ForCausalLM,
        "olmoe": tf.OlmoeForCausalLM,
        "glm4_moe": tf.Glm4MoeForCausalLM,
        "glm4_moe_lite": tf.Glm4MoeLiteForCausalLM,
        "minimax_m2": tf.MiniMaxM2ForCausalLM,
        "gemma4": tf.Gemma4ForCausalLM,
        "deepseek_v32": tf.DeepseekV32ForCausalLM,
        "glm_moe_dsa": tf.GlmMoeDsaForCausalLM,
        "deepseek_v4": tf.DeepseekV4ForCausalLM,
    }[family.split(":")[0]]


def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():  # DeepSeek's router bias (not rope tables)
            if name.endswith("e_score_correction_bias"):  # and GLM's / MiniMax-M2's
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            if name.endswith("layer_scalar"):  # Gemma-4's per-layer output scale
                b.copy_(1.0 + torch.randn(b.shape, generator=g) * 0.2)
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("bias") or "sinks" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
            if "A_log" in name:
                p.copy_(torch.rand(p.shape, generator=g).mul(2.0).add(0.1).log())
            if name.endswith("router.proj.weight"):  # Gemma-4 scales the router input by
                p.mul_(30.0)  # hidden^-0.5: spread its logits so the top-k are not near ties
        # DeepSeek-V4's zero-initialised tables (own generator: the draws above stay as they
        # were for the other families): the compressors' 2-d position biases, and the hash
        # layers' token -> experts table (else every token goes to expert 0 twice)
        g4 = torch.Generator().manual_seed(seed + 1000)
        for name, p in model.named_parameters():
            if name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=g4) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                rows = [torch.randperm(experts, generator=g4)[: b.shape[1]] for _ in b]
                b.copy_(torch.stack(rows))


def make_tiny(
    family: str, out: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **over: Any
) -> tuple[Path, Any]:
    """Writes a tiny checkpoint of ``family`` to ``out``; returns (out, the HF model in eval mode)."""
    torch.manual_seed(seed)
    cfg = hf_config(family, **over)
    model = hf_model_class(family)(cfg).eval()
    perturb(model, seed + 1)
    model = model.to(dtype)
    model.save_pretrained(out)
    return out, model
