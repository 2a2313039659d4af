"""A ModelConfig from a GGUF file's metadata (llama.cpp's key names, ``<arch>.<key>``).

The metadata is translated into the config.json fields transformers would write for the same
model, and that goes through the one config parser (``config_hf.from_dict``), so a GGUF and an HF
folder of the same model give the same ModelConfig.
"""

from __future__ import annotations

import re
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
}
# llama.cpp's routers: which ones renormalise the top-k weights when the file does not say.
_NORM_TOPK = {"qwen3moe": True, "olmoe": False, "llama": True, "gpt-oss": True}
_EXPERTS_KEY = {
    "qwen3moe": "num_experts",
    "olmoe": "num_experts",
    "llama": "num_local_experts",
    "gpt-oss": "num_local_experts",
}


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
    meta: dict[str, Any], tensors: dict[str, GgufTensor], dtype: str, source: str
) -> dict[str, Any]:
    """The config.json fields for this file (``dtype``: the weights' dtype in memory)."""
    arch = gguf_arch(meta, source)

    def get(key: str, default: Any = ...) -> Any:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            if default is ...:
                raise ConfigError(f"{source}: missing GGUF metadata key '{arch}.{key}'")
            return default
        return v

    n = int(get("block_count"))
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts: all must agree for our attention
        if len(set(kv_heads)) != 1:
            raise ConfigError(f"{source}: per-layer '{arch}.attention.head_count_kv' differ")
        kv_heads = kv_heads[0]
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"{source}: missing tensor 'token_embd.weight'")
    ffn = int(get("feed_forward_length", 0) or 0)
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
    }
    if mxfp4_experts(tensors):  # kept packed in our mxfp4 banks (same codes and scales)
        out["quantization_config"] = {"quant_method": "mxfp4"}
    if (clip := get("attention.clamp_kqv", None)) is not None:
        out["clip_qkv"] = float(clip)
    if arch == "qwen3moe":  # layers without a router are dense (llama.cpp files have none)
        out["mlp_only_layers"] = [
            i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
        ]
    if arch == "gpt-oss":
        out.update(_gptoss(get))
    for key, field in (("eos_token_id", "eos_token_id"), ("bos_token_id", "bos_token_id")):
        tid = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(tid, int):
            out[field] = tid
    return out


def mxfp4_experts(tensors: dict[str, GgufTensor]) -> bool:
    """True when every stacked expert weight is MXFP4 (GPT-OSS files)."""
    exps = [t for n, t in tensors.items() if re.search(r"\.ffn_(gate|up|down)_exps\.weight$", n)]
    return bool(exps) and all(t.type_name == "MXFP4" for t in exps)


def _gptoss(get: Any) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base"))}
    if get("rope.scaling.type", None) == "yarn":
        rope.update(
            rope_type="yarn",
            factor=float(get("rope.scaling.factor")),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
            beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
            truncate=False,  # GPT-OSS's YaRN keeps the fractional correction range
        )
    return {
        "rope_parameters": rope,
        "sliding_window": int(get("attention.sliding_window")),
        "attention_bias": True,
    }


def config_from_gguf(
    meta: dict[str, Any], tensors: dict[str, GgufTensor], dtype: str, source: str
) -> ModelConfig:
    return from_dict(hf_fields(meta, tensors, dtype, source), source=source)
