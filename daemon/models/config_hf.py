"""Reading a Hugging Face ``config.json`` into :class:`ModelConfig`: the one place that does.

Every family's spelling of the same idea is normalised here (``num_experts`` vs
``num_local_experts``, ``rope_theta`` vs ``rope_parameters``, a multimodal wrapper's nested
``text_config``, transformers' defaults for absent keys, ...). Model code reads only the fields
of :class:`ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .config import ARCHITECTURES, ConfigError, ModelConfig, RopeConfig

# Families with multi-head latent attention (kv_lora_rank) and the grouped sigmoid router.
_MLA_FAMILIES = ("deepseek_v3", "glm4_moe_lite")
# Families whose router is sigmoid + score-correction bias (+ optional group limit).
_SIGMOID_ROUTER_FAMILIES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "minimax_m2")
# Families whose shared experts are n_shared_experts plain MLPs fused into one, without a gate.
_PLAIN_SHARED_FAMILIES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
# What transformers assumes when config.json leaves out a field that changes the math (the
# original DeepSeek-V3 configs predate rope_interleave, for one). Applied only to absent keys:
# an explicit null (q_lora_rank: null = no q compression) stays.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(
        rope_interleave=True,
        q_lora_rank=1536,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        first_k_dense_replace=3,
    ),
    "glm4_moe": dict(
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        n_shared_experts=1,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
    ),
    "glm4_moe_lite": dict(
        rope_interleave=True,
        q_lora_rank=768,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.8,
        n_shared_experts=1,
        num_nextn_predict_layers=1,  # transformers skips model.layers.<n> of GLM-4.7-Flash
    ),
}


def _get(
    d: dict[str, Any], key: str, typ: type | tuple[type, ...], source: str, default: Any = ...
) -> Any:
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"{source}: missing field '{key}'")
        return default
    val = d[key]
    if typ is float and isinstance(val, int) and not isinstance(val, bool):
        val = float(val)
    if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
        raise ConfigError(f"{source}: field '{key}' must be {typ}, got {type(val).__name__}")
    return val


def _first(d: dict[str, Any], keys: tuple[str, ...], source: str, default: Any = ...) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return _get(d, k, int, source)
    if default is ...:
        raise ConfigError(f"{source}: missing field '{keys[0]}' (or {', '.join(keys[1:])})")
    return default


def _eos_ids(raw: dict[str, Any], text: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for d in (raw, text):
        v = d.get("eos_token_id")
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, list):
            ids.extend(int(x) for x in v)
    return tuple(dict.fromkeys(ids))


def _rope(
    text: dict[str, Any], head_dim: int, source: str, partial_default: float = 1.0
) -> RopeConfig:
    if text.get("qk_rope_head_dim"):  # MLA: only the rope part of each head rotates
        head_dim = int(text["qk_rope_head_dim"])
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{source}: field 'rope_parameters' must be an object")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = merged.get("partial_rotary_factor", text.get("partial_rotary_factor"))
    if partial is None and text.get("rotary_dim"):  # MiniMax-M2 spells it as a dim count
        partial = int(text["rotary_dim"]) / head_dim
    if partial is None:
        partial = partial_default
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(
            f"{source}: field 'rope_parameters.rope_type' = {kind!r} is not supported"
        )
    rotary_dim = int(head_dim * float(partial))
    if rotary_dim % 2:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' gives an odd rotary dim")
    factor = float(merged.get("factor", 1.0) or 1.0)
    attn_factor = merged.get("attention_factor")
    if attn_factor is None and kind == "yarn":
        attn_factor = _yarn_mscale(factor, merged.get("mscale"), merged.get("mscale_all_dim"))
    return RopeConfig(
        theta=float(theta),
        rotary_dim=rotary_dim,
        kind=kind,
        factor=factor,
        attention_factor=float(attn_factor or 1.0),
        interleaved=bool(text.get("rope_interleave", False)),
        mscale_all_dim=float(merged.get("mscale_all_dim", 0) or 0),
        original_max_position=int(merged.get("original_max_position_embeddings", 0) or 0),
        beta_fast=float(merged.get("beta_fast", 32.0)),
        beta_slow=float(merged.get("beta_slow", 1.0)),
        truncate=bool(merged.get("truncate", True)),
    )


def _yarn_mscale(factor: float, mscale: Any, mscale_all_dim: Any) -> float:
    def m(scale: float, k: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return m(factor, float(mscale)) / m(factor, float(mscale_all_dim))
    return m(factor)


def _layer_types(text: dict[str, Any], family: str, n: int, source: str) -> tuple[str, ...]:
    lt = text.get("layer_types")
    if lt is None:
        if family in ("qwen3_5_moe", "qwen3_next"):
            interval = int(text.get("full_attention_interval", 4))
            lt = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
        elif family == "gpt_oss":
            lt = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        elif family == "gemma4":  # transformers' default: five sliding layers, then a full one
            lt = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
        elif text.get("sliding_window") and text.get("use_sliding_window", family == "mixtral"):
            lt = ["sliding_attention"] * n
        else:
            lt = ["full_attention"] * n
    if not isinstance(lt, list) or len(lt) != n:
        raise ConfigError(f"{source}: field 'layer_types' must list {n} entries")
    allowed = {"full_attention", "sliding_attention", "linear_attention"}
    for t in lt:
        if t not in allowed:
            raise ConfigError(f"{source}: field 'layer_types' has unsupported entry {t!r}")
    return tuple(lt)


def _shared_size(text: dict[str, Any], family: str, moe_inter: int, source: str) -> int:
    if family in ("qwen3_5_moe", "qwen3_next"):
        return int(_get(text, "shared_expert_intermediate_size", int, source, 0))
    if family in _PLAIN_SHARED_FAMILIES:  # n_shared_experts experts fused into one MLP
        return moe_inter * int(_get(text, "n_shared_experts", int, source, 0))
    return 0


def _moe_layers(text: dict[str, Any], family: str, n: int, source: str) -> tuple[bool, ...]:
    if family in ("deepseek_v3", "glm4_moe"):
        first_dense = int(text.get("first_k_dense_replace") or 0)
        return tuple(i >= first_dense for i in range(n))
    if family == "glm4_moe_lite":
        kinds = text.get("mlp_layer_types")
        if kinds is None:  # transformers' default: the first layer dense, then sparse
            return tuple(i >= 1 for i in range(n))
        if not isinstance(kinds, list) or len(kinds) != n:
            raise ConfigError(f"{source}: field 'mlp_layer_types' must list {n} entries")
        return tuple(k == "sparse" for k in kinds)
    if family not in ("qwen3_moe", "qwen3_next"):
        return (True,) * n
    step = int(text.get("decoder_sparse_step", 1) or 1)
    dense = set(text.get("mlp_only_layers") or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))


def from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ConfigError(f"{source}: missing field 'architectures'")
    arch = archs[0]
    family = ARCHITECTURES.get(arch)
    if family is None:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ConfigError(
            f"{source}: field 'architectures' = {arch!r} is not supported (known: {known})"
        )
    text = raw
    prefix = "model"
    if isinstance(raw.get("text_config"), dict):  # multimodal wrapper, served text-only
        text = {**raw["text_config"]}
        prefix = "model.language_model"
    defaults = _FAMILY_DEFAULTS.get(family, {})
    text = {**{k: v for k, v in defaults.items() if k not in text}, **text}
    if family == "gemma4":
        text = _gemma4_text(text, source)
    hidden = _get(text, "hidden_size", int, source)
    heads = _get(text, "num_attention_heads", int, source)
    n = _get(text, "num_hidden_layers", int, source)
    head_dim = _get(text, "head_dim", int, source, hidden // heads)
    num_experts = _first(text, ("num_experts", "num_local_experts", "n_routed_experts"), source)
    top_k = _get(text, "num_experts_per_tok", int, source)
    if not 0 < top_k <= num_experts:
        raise ConfigError(
            f"{source}: field 'num_experts_per_tok' = {top_k} must be in [1, {num_experts}]"
        )
    inter = _get(text, "intermediate_size", int, source, 0)
    moe_inter = _get(text, "moe_intermediate_size", int, source, inter)
    if moe_inter <= 0:
        raise ConfigError(
            f"{source}: missing field 'moe_intermediate_size' (or 'intermediate_size')"
        )
    # Qwen3.5 renormalises the top-k weights unconditionally; Mixtral too; GPT-OSS takes the
    # softmax over the top-k logits, which is the same thing.
    norm_default = family in (
        "qwen3_5_moe",
        "qwen3_next",
        "mixtral",
        "gpt_oss",
        "deepseek_v3",
        "glm4_moe",
        "glm4_moe_lite",
    )
    norm_topk = bool(text.get("norm_topk_prob", norm_default))
    if family in ("mixtral", "gpt_oss", "minimax_m2"):
        norm_topk = True
    is_gptoss = family == "gpt_oss"
    is_q35 = family in ("qwen3_5_moe", "qwen3_next")  # the gated-attention / DeltaNet hybrids
    is_ds = family in _MLA_FAMILIES
    sigmoid = family in _SIGMOID_ROUTER_FAMILIES
    grouped = family in ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
    if is_ds:
        head_dim = _get(text, "qk_nope_head_dim", int, source) + _get(
            text, "qk_rope_head_dim", int, source
        )
    cfg = ModelConfig(
        family=family,
        architecture=arch,
        vocab_size=_get(text, "vocab_size", int, source),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=_get(text, "num_key_value_heads", int, source, heads),
        head_dim=head_dim,
        rms_norm_eps=_get(text, "rms_norm_eps", float, source, 1e-6),
        max_position_embeddings=_get(text, "max_position_embeddings", int, source, 4096),
        rope=_rope(text, head_dim, source, 0.5 if family == "glm4_moe" else 1.0),
        layer_types=_layer_types(text, family, n, source),
        moe_layers=_moe_layers(text, family, n, source),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=norm_topk,
        intermediate_size=inter,
        shared_expert_intermediate_size=_shared_size(text, family, moe_inter, source),
        sliding_window=_get(text, "sliding_window", int, source, None),
        attention_bias=bool(text.get("attention_bias", is_gptoss)),
        attention_sinks=is_gptoss,
        attention_output_gate=is_q35,
        qk_norm={
            "qwen3_moe": "head",
            "qwen3_5_moe": "head",
            "qwen3_next": "head",
            "olmoe": "full",
            "minimax_m2": "full",
            "glm4_moe": "head" if text.get("use_qk_norm") else "none",
        }.get(family, "none"),
        norm_offset=is_q35,
        clip_qkv=_get(text, "clip_qkv", float, source, None),
        o_proj_bias=bool(text.get("attention_bias", is_gptoss)) and family != "glm4_moe",
        router_bias=is_gptoss,
        expert_bias=is_gptoss,
        activation="gptoss" if is_gptoss else "silu",
        swiglu_alpha=float(text.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(text.get("swiglu_limit", 7.0)),
        tie_word_embeddings=bool(
            raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        ),
        linear_num_key_heads=_get(text, "linear_num_key_heads", int, source, 0),
        linear_num_value_heads=_get(text, "linear_num_value_heads", int, source, 0),
        linear_key_head_dim=_get(text, "linear_key_head_dim", int, source, 0),
        linear_value_head_dim=_get(text, "linear_value_head_dim", int, source, 0),
        linear_conv_kernel=_get(text, "linear_conv_kernel_dim", int, source, 0),
        q_lora_rank=_get(text, "q_lora_rank", int, source, 0) if is_ds else 0,
        kv_lora_rank=_get(text, "kv_lora_rank", int, source) if is_ds else 0,
        qk_nope_head_dim=_get(text, "qk_nope_head_dim", int, source, 0) if is_ds else 0,
        qk_rope_head_dim=_get(text, "qk_rope_head_dim", int, source, 0) if is_ds else 0,
        v_head_dim=_get(text, "v_head_dim", int, source, 0) if is_ds else 0,
        router_kind="sigmoid_group" if sigmoid else "topk_softmax" if is_gptoss else "softmax",
        n_group=_get(text, "n_group", int, source, 1) if grouped else 1,
        topk_group=_get(text, "topk_group", int, source, 1) if grouped else 1,
        routed_scaling_factor=_get(text, "routed_scaling_factor", float, source, 1.0)
        if grouped
        else 1.0,
        shared_expert_gated=family not in _PLAIN_SHARED_FAMILIES,
        router_fp32=grouped,
        num_mtp_layers=_get(text, "num_nextn_predict_layers", int, source, 0),
        eos_token_ids=_eos_ids(raw, text),
        torch_dtype=str(
            text.get("torch_dtype")
            or text.get("dtype")
            or raw.get("torch_dtype")
            or raw.get("dtype")
            or "float32"
        ),
        weight_prefix=prefix,
        expert_format=_expert_format(raw, text, source),
        raw=raw,
    )
    if family == "gemma4":
        cfg = dataclasses.replace(cfg, **_gemma4_fields(text, cfg, source))
    _validate(cfg, source)
    return cfg


def _gemma4_text(text: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma-4's spellings of the shared fields, and what we do not serve."""
    if not text.get("enable_moe_block"):
        raise ConfigError(
            f"{source}: field 'enable_moe_block' is false: only the Gemma-4 MoE models are served"
        )
    if text.get("use_bidirectional_attention") == "all":
        raise ConfigError(f"{source}: field 'use_bidirectional_attention' = 'all' is not supported")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: field 'hidden_activation' = {act!r} is not supported")
    out = {"head_dim": 256, "sliding_window": 512, "tie_word_embeddings": True, **text}
    out["num_experts_per_tok"] = text.get("top_k_experts")
    out["norm_topk_prob"] = True  # the router always renormalises its top-k
    return out


def _gemma4_fields(text: dict[str, Any], cfg: ModelConfig, source: str) -> dict[str, Any]:
    """Per-layer geometry (global layers: another head dim and KV head count), the two ropes,
    KV sharing, per-layer input embeddings and softcapping, as transformers reads them."""
    n = cfg.num_layers
    per_layer = text.get("per_layer_config")
    if isinstance(per_layer, dict):  # written by transformers: layer index -> overrides
        over = {int(k): v for k, v in per_layer.items() if isinstance(v, dict)}
    else:  # Google's configs: global_head_dim / num_global_key_value_heads for full layers
        o: dict[str, Any] = {"head_dim": _get(text, "global_head_dim", int, source, 512)}
        if text.get("attention_k_eq_v") and text.get("num_global_key_value_heads"):
            o["num_key_value_heads"] = _get(text, "num_global_key_value_heads", int, source)
        over = {i: o for i, t in enumerate(cfg.layer_types) if t == "full_attention"}
    dims = tuple(int(over.get(i, {}).get("head_dim", cfg.head_dim)) for i in range(n))
    kvh = tuple(int(over.get(i, {}).get("num_key_value_heads", cfg.num_kv_heads)) for i in range(n))
    params = text.get("rope_parameters") or {}
    full_dim = next((dims[i] for i, t in enumerate(cfg.layer_types) if t == "full_attention"), 0)
    return dict(
        layer_head_dims=dims,
        layer_kv_heads=kvh,
        rope=_gemma4_rope(params.get("sliding_attention"), cfg.head_dim, 10_000.0, source),
        rope_full=_gemma4_rope(params.get("full_attention"), full_dim, 1_000_000.0, source),
        attention_k_eq_v=bool(text.get("attention_k_eq_v", False)),
        num_kv_shared_layers=_get(text, "num_kv_shared_layers", int, source, 0),
        double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
        hidden_size_per_layer_input=_get(text, "hidden_size_per_layer_input", int, source, 0),
        vocab_size_per_layer_input=_get(
            text, "vocab_size_per_layer_input", int, source, cfg.vocab_size
        ),
        final_logit_softcapping=_get(text, "final_logit_softcapping", float, source, None),
        activation="gelu_tanh",
        attention_bias=bool(text.get("attention_bias", False)),
        o_proj_bias=bool(text.get("attention_bias", False)),
    )


def _gemma4_rope(params: Any, head_dim: int, theta: float, source: str) -> RopeConfig:
    """One layer type's rope: "default" over the whole head, or "proportional"."""
    p = params if isinstance(params, dict) else {}
    kind = p.get("rope_type", "default") or "default"
    if kind not in ("default", "proportional"):
        raise ConfigError(f"{source}: Gemma-4 rope_type {kind!r} is not supported")
    if float(p.get("factor", 1.0) or 1.0) != 1.0:
        raise ConfigError(f"{source}: Gemma-4 rope 'factor' != 1 is not supported")
    return RopeConfig(
        theta=float(p.get("rope_theta", theta)),
        rotary_dim=head_dim,
        kind=kind,
        proportion=float(p.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0,
    )


def _expert_format(raw: dict[str, Any], text: dict[str, Any], source: str) -> str:
    """The routed experts' stored format from ``quantization_config`` (none: float banks)."""
    q = text.get("quantization_config") or raw.get("quantization_config")
    if q is None:
        return "bf16"
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "mxfp4":
        return "mxfp4"
    raise ConfigError(
        f"{source}: field 'quantization_config.quant_method' = {method!r} is not supported "
        "(supported: mxfp4, or an unquantized checkpoint)"
    )


def _validate(cfg: ModelConfig, source: str) -> None:
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"{source}: field 'num_key_value_heads' must divide num_attention_heads")
    if cfg.has_linear_attention:
        for name in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel",
        ):
            if getattr(cfg, name) <= 0:
                raise ConfigError(f"{source}: linear attention needs field '{name}' > 0")
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ConfigError(
                f"{source}: field 'linear_num_key_heads' must divide linear_num_value_heads"
            )
    if cfg.num_kv_shared_layers:
        first = cfg.num_layers - cfg.num_kv_shared_layers
        if not 0 < first <= cfg.num_layers or set(cfg.layer_types[first:]) - set(
            cfg.layer_types[:first]
        ):
            raise ConfigError(
                f"{source}: field 'num_kv_shared_layers' leaves a shared layer type without an "
                "earlier layer of that type to share from"
            )
    if cfg.hidden_size_per_layer_input and cfg.vocab_size_per_layer_input < cfg.vocab_size:
        # every token id indexes the per-layer embedding too
        raise ConfigError(f"{source}: field 'vocab_size_per_layer_input' must be >= vocab_size")
    for i in range(cfg.num_layers):
        if cfg.num_heads % cfg.layer_num_kv_heads(i):
            raise ConfigError(f"{source}: layer {i}'s KV head count must divide the heads")
    if "sliding_attention" in cfg.layer_types and not cfg.sliding_window:
        raise ConfigError(f"{source}: sliding attention layers need field 'sliding_window'")
    grouped = cfg.router_kind == "sigmoid_group"
    if grouped and (cfg.n_group <= 0 or cfg.num_experts % cfg.n_group):
        raise ConfigError(f"{source}: field 'n_group' must divide n_routed_experts")
    if grouped and not 0 < cfg.topk_group <= cfg.n_group:
        raise ConfigError(f"{source}: field 'topk_group' must be in [1, n_group]")
    if cfg.torch_dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{source}: field 'torch_dtype' = {cfg.torch_dtype!r} is not supported")
    if cfg.expert_format == "mxfp4" and (
        cfg.hidden_size % 32 or cfg.moe_intermediate_size % 32 or not cfg.num_experts
    ):
        raise ConfigError(
            f"{source}: mxfp4 experts need hidden_size and the expert intermediate size to be "
            "multiples of 32"
        )
