"""GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3.2's sparse attention (``deepseek_v32``) with
two differences: the indexer's rope rotates interleaved pairs, and layers whose
``indexer_types`` entry is "shared" have no indexer of their own but reuse the selection of the
last layer that has one. Without ``indexer_types`` the pattern comes, as in transformers, from
``index_topk_pattern`` ("F" full, "S" shared) or from ``index_topk_freq`` /
``index_skip_topk_offset``.

Output syntax: GLM-4.7's (``glm_xml`` tool calls ``<tool_call>NAME<arg_key>K</arg_key>
<arg_value>V</arg_value></tool_call>``, ``<think>`` reasoning, GLM-4.5's anchors). GLM-5's own
chat template ships in its checkpoint and could not be checked offline: llama.cpp's tree has no
GLM-5 template (models/templates holds GLM-4.6's and GLM-4.7-Flash's), and its converter reads
GLM-5's vocabulary as GLM-4.5's (``_set_vocab_glm``: ``[gMASK]``, ``<|user|>`` ending a turn,
``<|observation|>``), the chat markup these anchors and GLM-4.7's syntax belong to. So GLM-4.7's
syntax is followed; a template that reveals another syntax overrides it (``detect_syntax``).

GLM-5.2 as released: its NVFP4 routed experts (ModelOpt's ``NVFP4`` or compressed-tensors'
``nvfp4-pack-quantized``) load packed as ``nvfp4`` (models/release_quant.py), the rest as stored.

In GGUF it is llama.cpp's ``glm-dsa``: DeepSeek-V3.2's tensors and keys (``dsa_gguf_rules``),
the rope's ``dimension_count`` scaled by the checkpoint's ``partial_rotary_factor``, and the
indexer layers as ``attention.indexer.types`` (True: a full indexer); a shared layer has no
indexer tensors. A file without that key is read as llama.cpp reads it: every layer full below
a 1M-token context (GLM-5, 5.1), GLM-5.2's pattern from 1M on."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError
from ..gguf_read import GgufMeta
from .deepseek_v32 import dsa_fields, dsa_gguf_fields, dsa_gguf_rules, dsa_moe_layers, dsa_normalize
from .glm4_moe import GLM_ANCHORS
from .spec import FamilySpec, HfRules

# llama.cpp's context length from which a glm-dsa file without indexer types is GLM-5.2
_GLM52_CONTEXT = 1048576


def _shared_layers(text: dict[str, Any], n: int, source: str) -> tuple[bool, ...]:
    """Per layer: True where its indexer type is "shared"."""
    kinds = text.get("indexer_types")
    if kinds is None:
        pattern = text.get("index_topk_pattern")
        if isinstance(pattern, str):
            letters = {"F": "full", "S": "shared"}
            if set(pattern) - set(letters):
                raise ConfigError(f"{source}: field 'index_topk_pattern' must be of 'F' and 'S'")
            kinds = [letters[c] for c in pattern]
        elif pattern is not None:
            kinds = list(pattern)
        else:
            freq = max(int(text.get("index_topk_freq") or 1), 1)
            offset = int(text.get("index_skip_topk_offset", 2))
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or set(kinds) - {"full", "shared"}:
        raise ConfigError(f"{source}: field 'indexer_types' must list {n} 'full' / 'shared'")
    if n and kinds[0] != "full":
        raise ConfigError(f"{source}: field 'indexer_types': layer 0 has no indexer to share")
    return tuple(k == "shared" for k in kinds)


def _glm52_indexers(n: int) -> list[bool]:
    """GLM-5.2's released indexer layers (its config.json, as llama.cpp keeps them): the first
    two full, then one full in every four."""
    return [i < 2 or (i - 2) % 4 == 0 for i in range(n)]


def _gguf_metadata(m: GgufMeta) -> dict[str, Any]:
    out = dsa_gguf_fields(m)
    full = m.get("attention.indexer.types", None)
    if full is None:
        ctx = int(m.get("context_length", 0) or 0)
        full = [True] * m.n if ctx < _GLM52_CONTEXT else _glm52_indexers(m.n)
    full = list(full)
    if len(full) < m.n:
        raise ConfigError(
            f"{m.source}: '{m.arch}.attention.indexer.types' lists {len(full)} layers, not {m.n}"
        )
    out["indexer_types"] = ["full" if f else "shared" for f in full[: m.n]]
    return out


SPEC = FamilySpec(
    architectures=("GlmMoeDsaForCausalLM",),
    hf=HfRules(
        # transformers' GlmMoeDsaConfig defaults
        defaults=dict(
            q_lora_rank=2048,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            first_k_dense_replace=3,
            index_topk=2048,
            index_head_dim=128,
            index_n_heads=32,
            rms_norm_eps=1e-5,
            max_position_embeddings=202752,
            num_nextn_predict_layers=1,  # transformers skips model.layers.<n> (the MTP layer)
        ),
        fixed={"router_kind": "sigmoid_group"},
        mla=True,
        grouped_router=True,
        shared_expert="plain",
        norm_topk_default=True,
        moe_layers=dsa_moe_layers,
        normalize=dsa_normalize,
        fields=dsa_fields(interleaved=True, shared=_shared_layers),
    ),
    gguf=dsa_gguf_rules("glm-dsa", _gguf_metadata),
    tool_syntax="glm_xml",
    reasoning_syntax="think",
    renames=(
        (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
        (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.score_bias"),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    ),
    anchors=GLM_ANCHORS,
)
