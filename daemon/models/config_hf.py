"""Reading a Hugging Face ``config.json`` into :class:`ModelConfig`: the one place that does.

The spellings of the same idea are normalised here (``num_experts`` vs ``num_local_experts``,
``rope_theta`` vs ``rope_parameters``, a multimodal wrapper's nested ``text_config``, ...). What
differs by family (transformers' defaults for absent keys, the router kind, MLA, the shared
expert, the default layer types, ...) is read from the family's ``FamilySpec.hf`` rules
(``families/``); no family is named here. Model code reads only the fields of
:class:`ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .config import ConfigError, ModelConfig
from .config_read import first, get, rope
from .families.spec import HfRules
from .registry import ARCHITECTURES, family_spec
from .release_quant import quant_config, release_quant


def _eos_ids(raw: dict[str, Any], text: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for d in (raw, text):
        v = d.get("eos_token_id")
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, list):
            ids.extend(int(x) for x in v)
    return tuple(dict.fromkeys(ids))


def _layer_types(text: dict[str, Any], rules: HfRules, n: int, source: str) -> tuple[str, ...]:
    lt = text.get("layer_types")
    if lt is None:
        if rules.layer_types is not None:
            lt = rules.layer_types(text, n)
        elif text.get("sliding_window") and text.get("use_sliding_window", False):
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


def _shared_size(text: dict[str, Any], rules: HfRules, moe_inter: int, source: str) -> int:
    if rules.shared_expert == "gated":
        return int(get(text, "shared_expert_intermediate_size", int, source, 0))
    if rules.shared_expert == "plain":  # n_shared_experts experts fused into one MLP
        return moe_inter * int(get(text, "n_shared_experts", int, source, 0))
    return 0


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
    rules = family_spec(family).hf
    text = raw
    prefix = "model"
    if isinstance(raw.get("text_config"), dict):  # multimodal wrapper, served text-only
        text = {**raw["text_config"]}
        prefix = "model.language_model"
    # the family's defaults for absent keys only: an explicit null (q_lora_rank: null = no q
    # compression) stays
    text = {**{k: v for k, v in rules.defaults.items() if k not in text}, **text}
    if rules.normalize is not None:
        text = rules.normalize(text, source)
    hidden = get(text, "hidden_size", int, source)
    heads = get(text, "num_attention_heads", int, source)
    n = get(text, "num_hidden_layers", int, source)
    head_dim = get(text, "head_dim", int, source, hidden // heads)
    num_experts = first(text, ("num_experts", "num_local_experts", "n_routed_experts"), source)
    top_k = get(text, "num_experts_per_tok", int, source)
    if not 0 < top_k <= num_experts:
        raise ConfigError(
            f"{source}: field 'num_experts_per_tok' = {top_k} must be in [1, {num_experts}]"
        )
    inter = get(text, "intermediate_size", int, source, 0)
    moe_inter = get(text, "moe_intermediate_size", int, source, inter)
    if moe_inter <= 0:
        raise ConfigError(
            f"{source}: missing field 'moe_intermediate_size' (or 'intermediate_size')"
        )
    mla = rules.mla
    grouped = rules.grouped_router
    if mla:
        head_dim = get(text, "qk_nope_head_dim", int, source) + get(
            text, "qk_rope_head_dim", int, source
        )
    attention_bias = bool(text.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        family=family,
        architecture=arch,
        vocab_size=get(text, "vocab_size", int, source),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=get(text, "num_key_value_heads", int, source, heads),
        head_dim=head_dim,
        rms_norm_eps=get(text, "rms_norm_eps", float, source, 1e-6),
        max_position_embeddings=get(text, "max_position_embeddings", int, source, 4096),
        rope=rope(text, head_dim, source, rules.partial_rotary_default),
        layer_types=_layer_types(text, rules, n, source),
        moe_layers=(
            rules.moe_layers(text, n, source) if rules.moe_layers is not None else (True,) * n
        ),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=bool(text.get("norm_topk_prob", rules.norm_topk_default)),
        intermediate_size=inter,
        shared_expert_intermediate_size=_shared_size(text, rules, moe_inter, source),
        sliding_window=get(text, "sliding_window", int, source, None),
        attention_bias=attention_bias,
        clip_qkv=get(text, "clip_qkv", float, source, None),
        o_proj_bias=attention_bias,
        swiglu_alpha=float(text.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(text.get("swiglu_limit", 7.0)),
        tie_word_embeddings=bool(
            raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        ),
        linear_num_key_heads=get(text, "linear_num_key_heads", int, source, 0),
        linear_num_value_heads=get(text, "linear_num_value_heads", int, source, 0),
        linear_key_head_dim=get(text, "linear_key_head_dim", int, source, 0),
        linear_value_head_dim=get(text, "linear_value_head_dim", int, source, 0),
        linear_conv_kernel=get(text, "linear_conv_kernel_dim", int, source, 0),
        q_lora_rank=get(text, "q_lora_rank", int, source, 0) if mla else 0,
        kv_lora_rank=get(text, "kv_lora_rank", int, source) if mla else 0,
        qk_nope_head_dim=get(text, "qk_nope_head_dim", int, source, 0) if mla else 0,
        qk_rope_head_dim=get(text, "qk_rope_head_dim", int, source, 0) if mla else 0,
        v_head_dim=get(text, "v_head_dim", int, source, 0) if mla else 0,
        n_group=get(text, "n_group", int, source, 1) if grouped else 1,
        topk_group=get(text, "topk_group", int, source, 1) if grouped else 1,
        routed_scaling_factor=get(text, "routed_scaling_factor", float, source, 1.0)
        if grouped
        else 1.0,
        shared_expert_gated=rules.shared_expert != "plain",
        router_fp32=grouped,
        num_mtp_layers=get(text, "num_nextn_predict_layers", int, source, 0),
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
    fields.update(rules.fixed)  # what the family always has, whatever config.json says
    cfg = ModelConfig(**fields)
    if rules.fields is not None:
        cfg = dataclasses.replace(cfg, **rules.fields(text, cfg, source))
    _validate(cfg, source)
    return cfg


def _expert_format(raw: dict[str, Any], text: dict[str, Any], source: str) -> str:
    """The routed experts' stored format from ``quantization_config`` (none: float banks).

    ``mxfp4``: GPT-OSS's fused blocks / scales. ``fp8``: fine-grained FP8 (DeepSeek's release,
    transformers' ``FineGrainedFP8Config``): block-scaled e4m3 dense weights, which the loader
    widens to the model's dtype; the routed experts are read only where ``expert_dtype`` says
    FP4 (e2m1 with an e8m0 scale per 32 inputs: our mxfp4, kept packed). It sits in
    ``quantization_config`` (transformers folds it there) or at the top level (the release).
    ``compressed-tensors`` / ``modelopt``: NVFP4 (our nvfp4) or INT4 groups (our q4_0), kept
    packed (release_quant)."""
    q = quant_config(raw, text)
    if q is None:
        return "bf16"
    if (rq := release_quant(q, source)) is not None:
        return rq.expert_format
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "mxfp4":
        return "mxfp4"
    if method == "fp8" and isinstance(q, dict):
        expert = q.get("expert_dtype") or text.get("expert_dtype") or raw.get("expert_dtype")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(
                f"{source}: field 'quantization_config.activation_scheme' = "
                f"{q['activation_scheme']!r} is not supported (only 'dynamic')"
            )
        if expert == "fp4":
            return "mxfp4"
        raise ConfigError(
            f"{source}: FP8 routed experts (quant_method 'fp8' with expert_dtype "
            f"{expert!r}) are not supported yet; FP8 dense weights with FP4 experts "
            "(expert_dtype 'fp4') are"
        )
    raise ConfigError(
        f"{source}: field 'quantization_config.quant_method' = {method!r} is not supported "
        "(supported: mxfp4, fp8 with expert_dtype fp4, compressed-tensors NVFP4 / INT4, "
        "modelopt NVFP4, or an unquantized checkpoint)"
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
    block = {"mxfp4": 32, "q4_0": 32, "nvfp4": 16}.get(cfg.expert_format)
    if block and (cfg.hidden_size % block or cfg.moe_intermediate_size % block):
        raise ConfigError(
            f"{source}: {cfg.expert_format} experts need hidden_size and the expert "
            f"intermediate size to be multiples of {block}"
        )
    if cfg.expert_format != "bf16" and not cfg.num_experts:
        raise ConfigError(f"{source}: quantized routed experts in a model without experts")


def read_config_json(model_dir: str | Path) -> tuple[dict[str, Any], str]:
    """(the parsed ``config.json`` of an HF model folder, its path as errors name it)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json in the model folder") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    hf_quant = Path(model_dir) / "hf_quant_config.json"
    if quant_config(raw) is None and hf_quant.exists():
        raw["quantization_config"] = _modelopt_file(hf_quant)
    return raw, str(path)


def _modelopt_file(path: Path) -> dict[str, Any]:
    """ModelOpt's ``hf_quant_config.json`` (older exports keep their quantization there, not in
    config.json) as a ``quantization_config``: its ``quantization`` block under the producer's
    name as ``quant_method``."""
    try:
        q = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    body = q.get("quantization") if isinstance(q, dict) else None
    producer = q.get("producer") if isinstance(q, dict) else None
    name = producer.get("name") if isinstance(producer, dict) else None
    if not isinstance(body, dict) or not isinstance(name, str):
        raise ConfigError(f"{path}: expected 'producer.name' and a 'quantization' object")
    return {"quant_method": name.lower(), **body}


def read_config(model_dir: str | Path) -> ModelConfig:
    """The ModelConfig of an HF model folder's ``config.json`` (errors name the file)."""
    raw, source = read_config_json(model_dir)
    return from_dict(raw, source=source)
