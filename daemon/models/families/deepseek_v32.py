"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3 with DeepSeek Sparse Attention. Each
layer's MLA attends, per query, only over the keys its Lightning Indexer selects: the
``index_topk`` best of all earlier tokens by a weighted sum of ReLU'd dot products between
``index_n_heads`` query heads and one LayerNorm'd key per token (``models/layers/dsa.py``). The
indexer's rope rotates half-split pairs, unlike the MLA's interleaved one. The MoE, router and
MLA are DeepSeek-V3's. The multi-token-prediction layer of the checkpoint is not loaded.
NVFP4 / INT4 routed experts as released load packed (models/release_quant.py).

The DSA rules here (``dsa_normalize``, ``dsa_fields``, ``dsa_moe_layers``) are shared with GLM-5
(``glm_moe_dsa``), which adds layers that reuse the previous indexer's selection.

In GGUF it is llama.cpp's ``deepseek32``: DeepSeek-V3's tensors and keys (``deepseek2``'s, kv_b
split the same way) plus the indexer's, which the converter names and leaves as they are
(``blk.N.indexer.{attn_q_b, attn_k, k_norm, proj}``; its rope layout is the family's, llama.cpp
rotates NEOX halves here and GLM-5's interleaved pairs), and its geometry under
``attention.indexer.*``. GLM-5 (``glm-dsa``) shares these rules (``dsa_gguf_rules``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import ConfigError, ModelConfig
from ..gguf_read import SHARED_EXPERT, SIGMOID, GgufMeta
from .deepseek_markup import DEEPSEEK_DSML_ANCHORS
from .deepseek_v3 import (
    KV_B_PARTS,
    MLA_BLOCK,
    first_k_dense,
    join_kv_b,
    mla_block_split,
    mla_gguf_fields,
)
from .spec import FamilySpec, GgufJoin, GgufRules, HfRules


def dsa_normalize(text: dict[str, Any], source: str) -> dict[str, Any]:
    """transformers' DSA configs: every layer ``indexed_attention`` (our full attention plus the
    indexer), the MLA's rope always interleaved (the config class has no ``rope_interleave``),
    the query always compressed (no ``q_lora_rank: null`` form)."""
    text = dict(text)
    kinds = text.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or any(
            k not in ("indexed_attention", "full_attention") for k in kinds
        ):
            raise ConfigError(
                f"{source}: field 'layer_types' must list only 'indexed_attention' layers"
            )
        text["layer_types"] = ["full_attention"] * len(kinds)
    if not text.get("q_lora_rank"):
        raise ConfigError(f"{source}: field 'q_lora_rank' must be set (DSA compresses the query)")
    text["rope_interleave"] = True
    return text


def dsa_moe_layers(text: dict[str, Any], n: int, source: str) -> tuple[bool, ...]:
    """``mlp_layer_types`` where listed (transformers writes it), else the first
    ``first_k_dense_replace`` layers dense."""
    kinds = text.get("mlp_layer_types")
    if kinds is None:
        return first_k_dense(text, n, source)
    if not isinstance(kinds, list) or len(kinds) != n or set(kinds) - {"dense", "sparse"}:
        raise ConfigError(f"{source}: field 'mlp_layer_types' must list {n} 'dense' / 'sparse'")
    return tuple(k == "sparse" for k in kinds)


def dsa_fields(
    interleaved: bool,
    shared: Callable[[dict[str, Any], int, str], tuple[bool, ...]] | None = None,
) -> Callable[[dict[str, Any], ModelConfig, str], dict[str, Any]]:
    """The ``HfRules.fields`` hook of a DSA family: the indexer's geometry, its rope's layout
    (``interleaved`` pairs or halves) and, from ``shared``, the layers that reuse the previous
    indexer's selection (None: none do)."""

    def fields(text: dict[str, Any], cfg: ModelConfig, source: str) -> dict[str, Any]:
        def positive(key: str) -> int:
            v = text.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{source}: field {key!r} must be a positive integer")
            return v

        topk, heads, dim = (positive(k) for k in ("index_topk", "index_n_heads", "index_head_dim"))
        if dim < cfg.qk_rope_head_dim:
            raise ConfigError(
                f"{source}: field 'index_head_dim' = {dim} is below qk_rope_head_dim "
                f"({cfg.qk_rope_head_dim}), the indexer's rotated part"
            )
        flags = shared(text, cfg.num_layers, source) if shared else (False,) * cfg.num_layers
        return dict(
            index_topk=topk,
            index_n_heads=heads,
            index_head_dim=dim,
            index_rope_interleaved=interleaved,
            index_shared=flags,
        )

    return fields


# the indexer's tensors as llama.cpp names them (the converter applies no transform to them)
INDEXER_BLOCK = {
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
}


def dsa_gguf_fields(m: GgufMeta) -> dict[str, Any]:
    """DeepSeek-V3's MLA and router fields (``deepseek_v3.mla_gguf_fields``) and the indexer's
    geometry. The converter writes ``expert_gating_func`` only from a config.json
    ``scoring_func``, which transformers' DSA configs lack: without it the router is the
    sigmoid one both families have. The dense layers are those without a router (llama.cpp
    reads ``leading_dense_block_count``, which says the same for the released models)."""
    out = mla_gguf_fields(m, gating_default=SIGMOID)
    out.update(
        mlp_layer_types=[
            "sparse" if m.has(f"blk.{i}.ffn_gate_inp.weight") else "dense" for i in range(m.n)
        ],
        index_n_heads=int(m.get("attention.indexer.head_count")),
        index_head_dim=int(m.get("attention.indexer.key_length")),
        index_topk=int(m.get("attention.indexer.top_k")),
    )
    return out


def dsa_gguf_rules(arch: str, metadata: Callable[[GgufMeta], dict[str, Any]]) -> GgufRules:
    """The GGUF rules of a DSA family: ``deepseek2``'s MLA tensors, kv_b joined back from
    ``attn_k_b`` / ``attn_v_b``, and the indexer's tensors."""
    return GgufRules(
        arch=arch,
        experts_key="n_routed_experts",
        norm_topk=False,
        metadata=metadata,
        block={**SHARED_EXPERT, **MLA_BLOCK, **INDEXER_BLOCK},
        block_split=mla_block_split,
        joins=(GgufJoin(KV_B_PARTS, "self_attn.kv_b_proj.weight", "attn_kv_b.weight", join_kv_b),),
    )


SPEC = FamilySpec(
    architectures=("DeepseekV32ForCausalLM",),
    hf=HfRules(
        # transformers' DeepseekV32Config defaults
        defaults=dict(
            q_lora_rank=1536,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            first_k_dense_replace=3,
            index_topk=2048,
            index_head_dim=128,
            index_n_heads=64,
            max_position_embeddings=163840,
            num_nextn_predict_layers=1,  # transformers skips model.layers.<n> (the MTP layer)
        ),
        fixed={"router_kind": "sigmoid_group"},
        mla=True,
        grouped_router=True,
        shared_expert="plain",
        norm_topk_default=True,
        moe_layers=dsa_moe_layers,
        normalize=dsa_normalize,
        fields=dsa_fields(interleaved=False),
    ),
    gguf=dsa_gguf_rules("deepseek32", dsa_gguf_fields),
    tool_syntax="deepseek_dsml_v3_2",
    reasoning_syntax="think",
    renames=(
        (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
        (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.score_bias"),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    ),
    anchors=DEEPSEEK_DSML_ANCHORS,
)
