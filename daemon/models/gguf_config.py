"""A ModelConfig from a GGUF file's metadata (llama.cpp's key names, ``<arch>.<key>``).

The metadata is translated into the config.json fields transformers would write for the same
model, and that goes through the one config parser (``config_hf.from_dict``), so a GGUF and an HF
folder of the same model give the same ModelConfig. The generic keys are read here; the family
that claims the file's ``general.architecture`` (its ``FamilySpec.gguf`` rules, ``families/``)
says which config.json key receives the expert count, llama.cpp's renormalisation default, and
reads its own keys in its metadata hook. No family is named here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..formats.gguf_file import GgufTensor
from .config import ConfigError, ModelConfig
from .config_hf import from_dict
from .families.spec import GgufRules
from .gguf_read import GgufMeta
from .registry import GGUF_ARCHITECTURES


def gguf_arch(meta: dict[str, Any], source: str) -> str:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ConfigError(f"{source}: no 'general.architecture' in the GGUF metadata")
    spec = GGUF_ARCHITECTURES.get(arch)
    if spec is None:
        known = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise ConfigError(f"{source}: GGUF architecture {arch!r} is not supported (known: {known})")
    if _rules(arch).needs_experts and not meta.get(f"{arch}.expert_count"):
        raise ConfigError(
            f"{source}: GGUF architecture {arch!r} without experts (a dense model) is not supported"
        )
    return arch


def _rules(arch: str) -> GgufRules:
    rules = GGUF_ARCHITECTURES[arch].gguf
    assert rules is not None  # the table holds the families with GGUF rules
    return rules


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
    spec = GGUF_ARCHITECTURES[arch]
    rules = _rules(arch)

    m = GgufMeta(arch, meta, tensors, source, n=0, head_dim=0, read=read)
    get = m.get
    # llama.cpp counts the multi-token-prediction layers in block_count (stored after the rest)
    mtp = int(get("nextn_predict_layers", 0) or 0)
    n = int(get("block_count")) - mtp
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list) and rules.kv_heads_vary:  # the metadata hook reads them
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
        "architectures": [spec.architectures[0]],
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        rules.experts_key: int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "intermediate_size": ffn,
        "moe_intermediate_size": int(get("expert_feed_forward_length", ffn)),
        "norm_topk_prob": bool(get("expert_weights_norm", rules.norm_topk)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": dtype,
        "num_nextn_predict_layers": mtp,
    }
    if (clip := get("attention.clamp_kqv", None)) is not None:
        out["clip_qkv"] = float(clip)
    if rules.metadata is not None:
        out.update(rules.metadata(dataclasses.replace(m, n=n, head_dim=out["head_dim"])))
    for key, field in (("eos_token_id", "eos_token_id"), ("bos_token_id", "bos_token_id")):
        tid = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(tid, int):
            out[field] = tid
    return out


def config_from_gguf(
    meta: dict[str, Any],
    tensors: dict[str, GgufTensor],
    dtype: str,
    source: str,
    read: Callable[[str], Any] | None = None,
) -> ModelConfig:
    return from_dict(hf_fields(meta, tensors, dtype, source, read), source=source)
