"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): its own top level (models/deepseek_v4_model.py,
``DeepseekV4CausalLM``), whose geometry (layer types, compress rates, indexer, hyper-connections,
hash layers, the two ropes) stays in ``ModelConfig.raw`` and is read by `v4_config`. The
ModelConfig fields say what the engine's generic parts need: every layer has the sliding
window (``layer_types`` all sliding, V4's own types in raw), the routed experts use the clamped
SwiGLU (``Activation.SWIGLU_CLAMP`` with ``swiglu_limit``), one shared expert of the routed
width.

Checkpoints: the names of the release, which transformers 5.25 also writes (under ``model.``,
``head.weight`` outside it), so the weight prefix is empty and the renames place every name;
the routed experts (``ffn.experts.<e>.w1 / w3 / w2``) go to the expert banks, the hash layers'
``tid2eid`` tables to integer buffers. MTP layers (``mtp.<i>.``) are skipped. Only
config.json is read in either form: as transformers writes it (``layer_types``,
``compress_rates``, ``mlp_layer_types``, ``partial_rotary_factor``, nested ``rope_parameters``)
or as the release ships it (``compress_ratios`` per layer, ``num_hash_layers``,
``qk_rope_head_dim``, a flat YaRN ``rope_scaling``), which `fold_legacy` folds the way
``DeepseekV4Config.__post_init__`` does. The release's quantization (``quant_method: fp8`` with
``expert_dtype: fp4``) is read by config_hf (routed experts: mxfp4, kept packed) and the loader
(FP8 dense weights widened at load).

In GGUF it is llama.cpp's ``deepseek4``, whose converter reads the release layout: the
release's tensor names renamed one for one (``GGUF_BLOCK``: no transform), the routed experts
repacked to MXFP4 blocks (read like GPT-OSS's), the hash layers' ``tid2eid`` as an I32 table
(their unused router bias dropped), and the release's config keys under llama.cpp's names
(``_gguf_metadata`` turns them back into the release's config.json keys, which `fold_legacy`
reads).

Chat markup: DSML tool calls and <think> reasoning (families/deepseek_markup.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, ModelConfig, RopeConfig
from ..gguf_read import SHARED_EXPERT, GgufMeta, yarn
from .deepseek_markup import DEEPSEEK_DSML_ANCHORS
from .spec import FamilySpec, GgufRules, HfRules

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]  # SLIDING | CSA | HCA per layer
    compress_rates: tuple[int, ...]  # per layer, 0 for sliding layers
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    hash_layers: tuple[bool, ...]  # per layer: routed by the token-id table
    swiglu_limit: float
    rope_main: RopeConfig  # sliding layers
    rope_compress: RopeConfig  # CSA / HCA layers, their compressors and indexers
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"


def _rope_config(p: Mapping[str, Any], rotary_dim: int) -> RopeConfig:
    kind = p.get("rope_type", p.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=float(p["rope_theta"]), rotary_dim=rotary_dim, interleaved=True)
    if kind != "yarn":
        raise ConfigError(f"DeepSeek-V4 rope type {kind!r} is not supported")
    return RopeConfig(
        theta=float(p["rope_theta"]),
        rotary_dim=rotary_dim,
        kind="yarn",
        factor=float(p["factor"]),
        original_max_position=int(p["original_max_position_embeddings"]),
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        # transformers 5.25 reads ``truncate`` from the outer {"main", "compress"} dict, where
        # it never is: the correction range is always truncated
        truncate=True,
        # transformers' config forces 1.0 for V4's compress rope (the cos/sin are not scaled)
        attention_factor=float(p.get("attention_factor", 1.0)),
        interleaved=True,
    )


def _layer_types_from_ratios(ratios: Any, n: int, rates: dict[str, int]) -> list[str]:
    """The release's ``compress_ratios`` (one per layer, possibly with the MTP layers' after
    them): 0 a sliding layer, 4 CSA, any other ratio HCA at that rate (transformers knows 128
    only; DeepSeek's reference builds the overlapping compressor and the indexer for 4 alone).
    Sets ``rates[HCA]`` from the ratios; every HCA layer must share it."""
    if not isinstance(ratios, list) or len(ratios) < n:
        raise ConfigError(f"field 'compress_ratios' must list at least {n} entries")
    types, hca = [], set()
    for r in ratios[:n]:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(f"field 'compress_ratios' has entry {r!r}; expected ints >= 0")
        types.append(SLIDING if r == 0 else CSA if r == rates[CSA] else HCA)
        if r and r != rates[CSA]:
            hca.add(r)
    if len(hca) > 1:
        raise ConfigError(f"field 'compress_ratios' has several HCA rates {sorted(hca)}")
    if hca:
        rates[HCA] = hca.pop()
    return types


def fold_legacy(hf: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json in transformers' form: the release's legacy keys folded in as
    ``DeepseekV4Config.__post_init__`` (transformers 5.25) folds them, and its defaults where
    both forms are absent. ``compress_rate_csa`` / ``compress_rate_hca`` override the rates;
    ``compress_ratios`` gives ``layer_types`` (else 2 HCA layers, then CSA / HCA alternating);
    ``num_hash_layers`` (default 3) the leading ``hash_moe`` layers of ``mlp_layer_types``;
    ``qk_rope_head_dim / head_dim`` the ``partial_rotary_factor`` (default 64 / 512); a flat
    ``rope_parameters`` / ``rope_scaling`` (YaRN) becomes the compress rope at
    ``compress_rope_theta``, the main rope plain at ``rope_theta``. A config.json in
    transformers' form comes back as it is (the legacy keys dropped)."""
    out = dict(hf)
    n = int(out["num_hidden_layers"])
    rates = {CSA: 4, HCA: 128, **(out.get("compress_rates") or {})}
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if out.get(key) is not None:
            rates[kind] = int(out[key])
        out.pop(key, None)
    ratios = out.pop("compress_ratios", None)
    if out.get("layer_types") is None:
        if ratios is not None:
            out["layer_types"] = _layer_types_from_ratios(ratios, n, rates)
        else:
            rest = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            out["layer_types"] = [HCA] * min(n, 2) + rest
    out["compress_rates"] = rates
    n_hash = out.pop("num_hash_layers", None)
    if out.get("mlp_layer_types") is None:
        n_hash = 3 if n_hash is None else int(n_hash)
        out["mlp_layer_types"] = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    if out.get("partial_rotary_factor") is None:
        rope_dim = out.get("qk_rope_head_dim")
        out["partial_rotary_factor"] = (
            int(rope_dim) / int(out["head_dim"]) if rope_dim is not None else 64 / 512
        )
    partial = out["partial_rotary_factor"]
    rp = out.get("rope_parameters") or {}
    scaling = out.pop("rope_scaling", None) or {}
    if not (isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)):
        flat = {k: v for k, v in {**scaling, **rp}.items() if k not in ("main", "compress", "type")}
        kind = {**scaling, **rp}.get("rope_type", {**scaling, **rp}.get("type", "default"))
        main = {
            "rope_type": "default",
            "rope_theta": out.get("rope_theta", 10000.0),
            "partial_rotary_factor": partial,
        }
        compress = {
            **flat,
            "rope_type": kind,
            "rope_theta": out.get("compress_rope_theta", 160000.0),
            "partial_rotary_factor": partial,
        }
        if kind == "yarn":
            compress.setdefault("attention_factor", 1.0)
        out["rope_parameters"] = {"main": main, "compress": compress}
    return out


def v4_config(hf: Mapping[str, Any]) -> V4Config:
    """Our V4Config from a config.json as transformers 5.25 writes it (``layer_types``,
    ``compress_rates``, ``mlp_layer_types``, ``partial_rotary_factor`` and the nested
    {"main", "compress"} ``rope_parameters`` filled in) or as the release ships it (its legacy
    keys folded by `fold_legacy`)."""
    hf = fold_legacy(hf)
    for key, want in (
        ("scoring_func", "sqrtsoftplus"),
        ("hidden_act", "silu"),
        ("mlp_bias", False),
    ):
        if hf.get(key, want) != want:
            raise ConfigError(
                f"DeepSeek-V4 with {key}={hf[key]!r} is not supported (only {want!r})"
            )
    n = int(hf["num_hidden_layers"])
    head_dim = int(hf["head_dim"])
    rotary = int(head_dim * float(hf["partial_rotary_factor"]))
    types = tuple(hf["layer_types"][:n])
    rates = tuple(0 if t == SLIDING else int(hf["compress_rates"][t]) for t in types)
    ropes = hf["rope_parameters"]
    return V4Config(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=n,
        num_heads=int(hf["num_attention_heads"]),
        head_dim=head_dim,
        q_lora_rank=int(hf["q_lora_rank"]),
        o_groups=int(hf["o_groups"]),
        o_lora_rank=int(hf["o_lora_rank"]),
        sliding_window=int(hf["sliding_window"]),
        rms_norm_eps=float(hf["rms_norm_eps"]),
        layer_types=types,
        compress_rates=rates,
        index_heads=int(hf["index_n_heads"]),
        index_head_dim=int(hf["index_head_dim"]),
        index_topk=int(hf["index_topk"]),
        hc_mult=int(hf["hc_mult"]),
        hc_sinkhorn_iters=int(hf["hc_sinkhorn_iters"]),
        hc_eps=float(hf["hc_eps"]),
        num_experts=int(hf["n_routed_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        hash_layers=tuple(t == "hash_moe" for t in hf["mlp_layer_types"][:n]),
        swiglu_limit=float(hf["swiglu_limit"]),
        rope_main=_rope_config(ropes["main"], rotary),
        rope_compress=_rope_config(ropes["compress"], rotary),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
    )


# Checkpoint tensor names (the release's, which transformers 5.25 also writes, then under a
# "model." prefix for all but head.weight) -> ours: top-level, and under layers.<i>.
TOP_NAMES = {
    "embed.weight": "embed_tokens.weight",
    "embed_tokens.weight": "embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.fn",
    "hc_head_base": "hc_head.base",
    "hc_head_scale": "hc_head.scale",
    "hc_head.hc_fn": "hc_head.fn",
    "hc_head.hc_base": "hc_head.base",
    "hc_head.hc_scale": "hc_head.scale",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",  # as transformers saves it
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",  # as released (llama.cpp's converter)
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.indexer.wq_b.weight": "self_attn.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
    "ffn.gate.weight": "mlp.router.weight",
    "ffn.gate.bias": "mlp.router.score_bias",
    "ffn.gate.tid2eid": "mlp.router.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
}
for _hc in ("attn", "ffn"):
    for _p in ("fn", "base", "scale"):
        LAYER_NAMES[f"hc_{_hc}_{_p}"] = f"{_hc}_hc.{_p}"
for _src, _dst in (
    ("attn.compressor.", "self_attn.compressor."),
    ("attn.indexer.compressor.", "self_attn.indexer.compressor."),
):
    for _a, _b in (
        ("wkv.weight", "kv_proj.weight"),
        ("wgate.weight", "gate_proj.weight"),
        ("ape", "position_bias"),
        ("norm.weight", "kv_norm.weight"),
    ):
        LAYER_NAMES[_src + _a] = _dst + _b


# llama.cpp's block tensor names -> the release's (its converter's table), placed by LAYER_NAMES
_GGUF_RELEASE = {
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "attn_sinks.weight": "attn.attn_sink",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
    **{
        f"hc_{h}_{p}.weight": f"hc_{h}_{p}"
        for h in ("attn", "ffn")
        for p in ("fn", "base", "scale")
    },
    **{
        f"{g}_compressor_{a}.weight": f"attn.{r}compressor.{b}"
        for g, r in (("attn", ""), ("indexer", "indexer."))
        for a, b in (
            ("kv", "wkv.weight"),
            ("gate", "wgate.weight"),
            ("ape", "ape"),
            ("norm", "norm.weight"),
        )
    },
}
GGUF_BLOCK = {
    **SHARED_EXPERT,
    **{g: LAYER_NAMES[r] for g, r in _GGUF_RELEASE.items()},
}
GGUF_TOP = {f"output_hc_{p}.weight": TOP_NAMES[f"hc_head_{p}"] for p in ("fn", "base", "scale")}
_SQRTSOFTPLUS = 4  # llama.cpp's expert_gating_func


def _gguf_metadata(m: GgufMeta) -> dict[str, Any]:
    """The release's config.json keys from llama.cpp's (its converter writes them from the
    release's): `fold_legacy` then reads them as it reads the release's folder."""
    if int(m.get("expert_gating_func")) != _SQRTSOFTPLUS:
        raise ConfigError(f"{m.source}: {m.arch} with a router other than sqrtsoftplus")
    clamps = {float(v) for v in m.get("swiglu_clamp_exp")[: m.n]}
    clamps |= {float(v) for v in m.get("swiglu_clamp_shexp", [])[: m.n]}
    if len(clamps) != 1:
        raise ConfigError(f"{m.source}: per-layer SwiGLU clamps {sorted(clamps)} differ")
    out: dict[str, Any] = {
        "q_lora_rank": int(m.get("attention.q_lora_rank")),
        "o_groups": int(m.get("attention.output_group_count")),
        "o_lora_rank": int(m.get("attention.output_lora_rank")),
        "sliding_window": int(m.get("attention.sliding_window")),
        "compress_ratios": [int(r) for r in m.get("attention.compress_ratios")],
        "compress_rope_theta": float(m.get("attention.compress_rope_freq_base")),
        "qk_rope_head_dim": int(m.get("rope.dimension_count")),
        "index_n_heads": int(m.get("attention.indexer.head_count")),
        "index_head_dim": int(m.get("attention.indexer.key_length")),
        "index_topk": int(m.get("attention.indexer.top_k")),
        "hc_mult": int(m.get("hyper_connection.count")),
        "hc_sinkhorn_iters": int(m.get("hyper_connection.sinkhorn_iterations")),
        "hc_eps": float(m.get("hyper_connection.epsilon")),
        "num_hash_layers": int(m.get("hash_layer_count")),
        "n_shared_experts": int(m.get("expert_shared_count")),
        "routed_scaling_factor": float(m.get("expert_weights_scale")),
        "swiglu_limit": clamps.pop(),
        "scoring_func": "sqrtsoftplus",
    }
    if scaling := yarn(m):  # the release's flat YaRN rope_scaling (the compress rope's)
        if (factor := m.get("rope.scaling.yarn_attn_factor", None)) is not None:
            scaling["attention_factor"] = float(factor)
        out["rope_scaling"] = scaling
    return out


def _text(text: dict[str, Any], source: str) -> dict[str, Any]:
    """Refuses what V4 does not compute (``v4_config``'s checks, the geometry keys it reads);
    then the generic reader's view: every layer sliding, the main rope flat."""
    try:
        text = fold_legacy(text)
        v4 = v4_config(text)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(
            f"{source}: not a DeepSeek-V4 config.json, neither as transformers writes it nor as "
            f"the release ships it ({e!r})"
        ) from None
    main = dict(text["rope_parameters"]["main"])
    main.setdefault("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    out = {**text, "layer_types": [SLIDING] * v4.num_layers, "rope_parameters": main}
    out.pop("qk_rope_head_dim", None)  # not MLA's: the rope dim follows partial_rotary_factor
    out["rope_interleave"] = True
    return out


def _fields(text: dict[str, Any], cfg: ModelConfig, source: str) -> dict[str, Any]:
    """The router's scale and the one shared expert (for the planner's sizes; the model builds
    it from V4Config), the query LoRA rank."""
    return dict(
        routed_scaling_factor=float(text["routed_scaling_factor"]),
        shared_expert_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_gated=False,
        q_lora_rank=int(text["q_lora_rank"]),
    )


def _renames() -> tuple[tuple[str, str], ...]:
    out = [(r"^model\.", "")]
    out += [(f"^{re.escape(k)}$", v) for k, v in TOP_NAMES.items()]
    out += [
        (rf"^layers\.(\d+)\.{re.escape(k)}$", rf"layers.\1.{v}") for k, v in LAYER_NAMES.items()
    ]
    # routed experts: w1 gate, w3 up, w2 down -> the loader's per-expert names (expert banks)
    for w, proj in (("1", "gate_proj"), ("3", "up_proj"), ("2", "down_proj")):
        out.append(
            (rf"^layers\.(\d+)\.ffn\.experts\.(\d+)\.w{w}\.", rf"layers.\1.mlp.experts.\2.{proj}.")
        )
    return tuple(out)


SPEC = FamilySpec(
    architectures=("DeepseekV4ForCausalLM",),
    hf=HfRules(
        fixed=dict(
            activation="swiglu_clamp",
            router_kind="sqrtsoftplus",  # or the token-id hash (hash layers): V4Router
            norm_topk_prob=True,  # V4 always renormalises the top-k
            weight_prefix="",
        ),
        normalize=_text,
        fields=_fields,
    ),
    model="deepseek_v4_model:DeepseekV4CausalLM",
    tool_syntax="deepseek_dsml",
    reasoning_syntax="think",
    gguf=GgufRules(
        arch="deepseek4",
        experts_key="n_routed_experts",
        norm_topk=True,
        metadata=_gguf_metadata,
        block=GGUF_BLOCK,
        top=GGUF_TOP,
    ),
    renames=_renames(),
    mtp=r"^(model\.)?mtp\.\d+\.",
    anchors=DEEPSEEK_DSML_ANCHORS,
)
