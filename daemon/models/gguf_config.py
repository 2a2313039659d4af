"""A ModelConfig from a GGUF file's metadata (llama.cpp's key names, ``<arch>.<key>``).

The metadata is translated into the config.json fields transformers would write for the same
model, and that goes through the one config parser (``config_hf.from_dict``), so a GGUF and an HF
folder of the same model give the same ModelConfig.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..formats.gguf_file import GgufTensor
from .config import ConfigError, ModelConfig
from .config_hf import from_dict

# GGUF ``general.architecture`` -> HF architecture (``llama`` counts only with experts: Mixtral).
GGUF_ARCHITECTURES = {
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "llama": "MixtralForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",
    "glm4moe": "Glm4MoeForCausalLM",
    "minimax-m2": "MiniMaxM2ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
}
# llama.cpp's routers: which ones renormalise the top-k weights when the file does not say.
_NORM_TOPK = {
    "qwen3moe": True,
    "olmoe": False,
    "llama": True,
    "gpt-oss": True,
    "qwen3next": True,
    "qwen35moe": True,
    "deepseek2": False,
    "glm4moe": True,
    "minimax-m2": True,
    "gemma4": True,
}
_EXPERTS_KEY = {
    "qwen3moe": "num_experts",
    "olmoe": "num_experts",
    "llama": "num_local_experts",
    "gpt-oss": "num_local_experts",
    "qwen3next": "num_experts",
    "qwen35moe": "num_experts",
    "deepseek2": "n_routed_experts",
    "glm4moe": "n_routed_experts",
    "minimax-m2": "num_local_experts",
    "gemma4": "num_experts",
}
_SIGMOID = 2  # llama.cpp's expert_gating_func for a sigmoid router


def gguf_arch(meta: dict[str, Any], source: str) -> str:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ConfigError(f"{source}: no 'general.architecture' in the GGUF metadata")
    if arch not in GGUF_ARCHITECTURES:
        known = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise ConfigError(f"{source}: GGUF architecture {arch!r} is not supported (known: {known})")
    if arch == "llama" and not meta.get("llama.expert_count"):
        raise ConfigError(
            f"{source}: GGUF architecture 'llama' without experts (a dense model) is not supported"
        )
    return arch


def hf_fields(
    meta: dict[str, Any],
    tensors: dict[str, GgufTensor],
    dtype: str,
    source: str,
    read: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """The config.json fields for this file (``dtype``: the weights' dtype in memory;
    ``read``: a tensor's values by name, for the few facts stored as a tensor)."""
    arch = gguf_arch(meta, source)

    def get(key: str, default: Any = ...) -> Any:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            if default is ...:
                raise ConfigError(f"{source}: missing GGUF metadata key '{arch}.{key}'")
            return default
        return v

    # llama.cpp counts the multi-token-prediction layers in block_count (stored after the rest)
    mtp = int(get("nextn_predict_layers", 0) or 0)
    n = int(get("block_count")) - mtp
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list) and arch == "gemma4":  # per layer type (see _gemma4)
        kv_heads = kv_heads[0]
    if isinstance(kv_heads, list):  # per-layer counts: all must agree for our attention
        counts = {k for k in kv_heads if k}  # (0: a layer without attention)
        if len(counts) != 1:
            raise ConfigError(f"{source}: per-layer '{arch}.attention.head_count_kv' differ")
        kv_heads = counts.pop()
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"{source}: missing tensor 'token_embd.weight'")
    ffn_raw = get("feed_forward_length", 0) or 0
    ffn = min(ffn_raw) if isinstance(ffn_raw, list) else int(ffn_raw)
    out: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        _EXPERTS_KEY[arch]: int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "intermediate_size": ffn,
        "moe_intermediate_size": int(get("expert_feed_forward_length", ffn)),
        "norm_topk_prob": bool(get("expert_weights_norm", _NORM_TOPK[arch])),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": dtype,
        "num_nextn_predict_layers": mtp,
    }
    if (clip := get("attention.clamp_kqv", None)) is not None:
        out["clip_qkv"] = float(clip)
    if arch in ("qwen3moe", "qwen3next"):  # layers without a router are dense
        out["mlp_only_layers"] = [
            i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
        ]
    if arch == "gpt-oss":
        out.update(_gptoss(get))
    if arch in ("qwen3next", "qwen35moe"):
        out.update(_hybrid(get, out["head_dim"], n, tensors))
    if arch == "deepseek2":
        out.update(_deepseek2(get, source))
        if is_glm_flash(meta):
            out.update(_glm_flash(n, tensors))
    if arch == "glm4moe":
        out.update(_glm4moe(get, out["head_dim"], n, tensors, source))
    if arch == "minimax-m2":
        out.update(_minimax_m2(get, out["head_dim"], source))
    if arch == "gemma4":
        out.update(_gemma4(get, n, tensors, source, read))
    for key, field in (("eos_token_id", "eos_token_id"), ("bos_token_id", "bos_token_id")):
        tid = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(tid, int):
            out[field] = tid
    return out


def _yarn(get: Any, **extra: Any) -> dict[str, Any]:
    """The rope fields of a file's YaRN scaling (``rope.scaling.*``), or none without it."""
    if get("rope.scaling.type", None) != "yarn":
        return {}
    return {
        "rope_type": "yarn",
        "factor": float(get("rope.scaling.factor")),
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
        **extra,
    }


def _gptoss(get: Any) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base"))}
    # GPT-OSS's YaRN keeps the fractional correction range
    rope.update(_yarn(get, truncate=False))
    return {
        "rope_parameters": rope,
        "sliding_window": int(get("attention.sliding_window")),
        "attention_bias": True,
    }


def _hybrid(get: Any, head_dim: int, n: int, tensors: dict[str, GgufTensor]) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5: the DeltaNet geometry from llama.cpp's ssm keys (state size = key
    head dim, group count = key heads, time-step rank = value heads, inner size = all value
    dims); a layer is full attention where the file has its ``attn_q``."""
    vh = int(get("ssm.time_step_rank"))
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "partial_rotary_factor": int(get("rope.dimension_count", head_dim)) / head_dim,
    }
    return {
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_num_value_heads": vh,
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_value_head_dim": int(get("ssm.inner_size")) // vh,
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "layer_types": [
            "full_attention" if f"blk.{i}.attn_q.weight" in tensors else "linear_attention"
            for i in range(n)
        ],
        "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0)),
        "rope_parameters": rope,
    }


def _deepseek2(get: Any, source: str) -> dict[str, Any]:
    """DeepSeek-V3's MLA and router from llama.cpp's keys. Files written since the converter
    splits kv_b carry the MLA head sizes in ``key_length_mla`` / ``value_length_mla`` (and 1 KV
    head, kv_lora + rope key length); older ones in ``key_length`` / ``value_length``."""
    if int(get("expert_gating_func", 1)) != _SIGMOID:
        raise ConfigError(
            f"{source}: deepseek2 with a softmax router (DeepSeek-V2) is not supported; "
            "only the sigmoid router of DeepSeek-V3"
        )
    rope_dim = int(get("rope.dimension_count"))
    qk = int(get("attention.key_length_mla", 0) or get("attention.key_length"))
    heads = int(get("attention.head_count"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base"))}
    if get("rope.scaling.type", None) == "yarn":
        mscale_all = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope.update(
            rope_type="yarn",
            factor=float(get("rope.scaling.factor")),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
            beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
            # the file keeps only mscale_all_dim; DeepSeek-V3's config has mscale equal to it
            mscale=mscale_all,
            mscale_all_dim=mscale_all,
        )
    return {
        "num_key_value_heads": heads,  # MLA: as many KV heads as query heads, in HF's terms
        "head_dim": qk,
        "q_lora_rank": int(get("attention.q_lora_rank", 0) or 0) or None,
        "kv_lora_rank": int(get("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk - rope_dim,
        "v_head_dim": int(get("attention.value_length_mla", 0) or get("attention.value_length")),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "n_group": int(get("expert_group_count", 1)),
        "topk_group": int(get("expert_group_used_count", 1)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "rope_interleave": True,  # the converter keeps DeepSeek's interleaved rope rows
        "rope_parameters": rope,
    }


def is_glm_flash(meta: dict[str, Any]) -> bool:
    """A ``deepseek2`` file that is GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``: llama.cpp writes it
    as DeepSeek-V2/V3): told by its GLM pre-tokenizer, by its name, or by the GLM chat markup
    (``[gMASK]<sop>``) of its template."""
    if meta.get("general.architecture") != "deepseek2":
        return False
    if meta.get("tokenizer.ggml.pre") == "glm4":
        return True
    names = " ".join(
        str(meta.get(k) or "")
        for k in ("general.basename", "general.name", "general.base_model.0.name")
    ).lower()
    if re.search(r"\bglm", names):
        return True
    template = meta.get("tokenizer.chat_template")
    return isinstance(template, str) and "[gMASK]" in template and "<|assistant|>" in template


def _glm_flash(n: int, tensors: dict[str, GgufTensor]) -> dict[str, Any]:
    """GLM-4.7-Flash's own fields over DeepSeek's: which layers are dense (those without a
    router; transformers' ``mlp_layer_types``)."""
    return {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "mlp_layer_types": [
            "sparse" if f"blk.{i}.ffn_gate_inp.weight" in tensors else "dense" for i in range(n)
        ],
    }


def _sigmoid_router(get: Any, arch: str, source: str) -> None:
    if int(get("expert_gating_func", _SIGMOID)) != _SIGMOID:
        raise ConfigError(f"{source}: {arch} with a softmax router is not supported")


def _plain_rope(get: Any, head_dim: int, rotary_dim: int) -> dict[str, Any]:
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "partial_rotary_factor": rotary_dim / head_dim,
    }
    rope.update(_yarn(get))
    return rope


def _glm4moe(
    get: Any, head_dim: int, n: int, tensors: dict[str, GgufTensor], source: str
) -> dict[str, Any]:
    """GLM-4.5 / 4.6 / 4.7: partial rotary (``rope.dimension_count`` of each head), the DeepSeek-V3
    router (sigmoid, ``exp_probs_b`` correction bias, groups, routed scaling), plain shared
    experts, the first ``leading_dense_block_count`` layers dense. The q/k norms and the q/k/v
    biases are optional in GLM's config: the file has their tensors or not."""
    _sigmoid_router(get, "glm4moe", source)
    return {
        "rope_parameters": _plain_rope(
            get, head_dim, int(get("rope.dimension_count", head_dim // 2))
        ),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "n_group": int(get("expert_group_count", 1) or 1),
        "topk_group": int(get("expert_group_used_count", 1) or 1),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }


def _minimax_m2(get: Any, head_dim: int, source: str) -> dict[str, Any]:
    """MiniMax-M2: partial rotary as a dim count (``rope.dimension_count``, HF's
    ``rotary_dim``), the sigmoid router with its correction bias, experts of
    ``expert_feed_forward_length``."""
    _sigmoid_router(get, "minimax-m2", source)
    rotary = int(get("rope.dimension_count", head_dim))
    return {
        "rotary_dim": rotary,
        "rope_parameters": _plain_rope(get, head_dim, rotary),
        "intermediate_size": int(get("expert_feed_forward_length")),
    }


def _gemma4(
    get: Any,
    n: int,
    tensors: dict[str, GgufTensor],
    source: str,
    read: Callable[[str], Any] | None,
) -> dict[str, Any]:
    """Gemma-4 with the MoE block: the converter keeps each layer type's geometry in its own
    keys (``key_length`` / ``head_count_kv`` entries of the global layers, ``*_swa`` and the
    sliding entries for the others), which layers slide in ``sliding_window_pattern``, and the
    global layers' proportional rope as ``rope_freqs`` (1 for a rotated pair, 1e30 for one left
    as is). A global layer without ``attn_v`` takes V = K (``attention_k_eq_v``)."""
    if not int(get("expert_count", 0) or 0):
        raise ConfigError(f"{source}: a Gemma-4 file without experts (dense) is not supported")
    if int(get("embedding_length_per_layer_input", 0) or 0):
        raise ConfigError(
            f"{source}: Gemma-4 with per-layer input embeddings (E2B / E4B) is not supported "
            "from GGUF"
        )
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) < n:
        raise ConfigError(
            f"{source}: 'gemma4.attention.sliding_window_pattern' must list {n} layers"
        )
    sliding = [bool(x) for x in pattern[:n]]
    kv = get("attention.head_count_kv", int(get("attention.head_count")))
    kv_of = kv if isinstance(kv, list) else [kv] * n
    full = [i for i in range(n) if not sliding[i]]
    swa = [i for i in range(n) if sliding[i]]
    full_dim = int(get("attention.key_length"))
    swa_dim = int(get("attention.key_length_swa", full_dim))
    partial = 1.0
    if read is not None and "rope_freqs.weight" in tensors:
        freqs = read("rope_freqs.weight")
        partial = float((freqs < 1e10).sum()) / (full_dim // 2)
    ffn = get("feed_forward_length", 0) or 0
    return {
        "head_dim": swa_dim,
        "global_head_dim": full_dim,
        "num_key_value_heads": int(kv_of[swa[0]] if swa else kv_of[0]),
        "per_layer_config": {
            str(i): {"head_dim": full_dim, "num_key_value_heads": int(kv_of[i])} for i in full
        },
        "attention_k_eq_v": bool(full)
        and all(f"blk.{i}.attn_v.weight" not in tensors for i in full),
        "layer_types": ["sliding_attention" if x else "full_attention" for x in sliding],
        "sliding_window": int(get("attention.sliding_window")),
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(get("rope.freq_base_swa", 10000.0)),
            },
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": partial,
                "rope_theta": float(get("rope.freq_base", 1_000_000.0)),
            },
        },
        "enable_moe_block": True,
        "top_k_experts": int(get("expert_used_count")),
        "num_kv_shared_layers": int(get("attention.shared_kv_layers", 0) or 0),
        "use_double_wide_mlp": isinstance(ffn, list) and len(set(ffn)) > 1,
        "hidden_size_per_layer_input": 0,
        "final_logit_softcapping": get("final_logit_softcapping", None),
        "attention_bias": False,
    }


def config_from_gguf(
    meta: dict[str, Any],
    tensors: dict[str, GgufTensor],
    dtype: str,
    source: str,
    read: Callable[[str], Any] | None = None,
) -> ModelConfig:
    return from_dict(hf_fields(meta, tensors, dtype, source, read), source=source)
