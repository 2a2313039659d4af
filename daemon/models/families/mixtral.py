"""Mixtral: Llama attention, softmax top-k router with renormalisation, w1/w3/w2 experts.

In GGUF it is llama.cpp's ``llama`` architecture with experts (without them, a dense Llama: not
served), whose converter permutes the Q/K rows for its interleaved rope."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import ModelConfig
from ..gguf_read import Fix
from .spec import FamilySpec, GgufRules, HfRules

if TYPE_CHECKING:
    import torch


def _llama_unpermute(n_head: int) -> Fix:
    """The converter stores HF row (head, half, pair) at file row (head, pair, half)."""

    def fix(t: torch.Tensor) -> torch.Tensor:
        rows = t.shape[0]
        return t.reshape(n_head, rows // n_head // 2, 2, -1).transpose(1, 2).reshape(t.shape)

    return fix


def _unpermute_qk(cfg: ModelConfig, key: str) -> Fix | None:
    if key == "attn_q.weight":
        return _llama_unpermute(cfg.num_heads)
    if key == "attn_k.weight":
        return _llama_unpermute(cfg.num_kv_heads)
    return None


SPEC = FamilySpec(
    architectures=("MixtralForCausalLM",),
    # transformers' Mixtral slides over sliding_window unless use_sliding_window says not
    hf=HfRules(defaults={"use_sliding_window": True}, fixed={"norm_topk_prob": True}),
    gguf=GgufRules(
        arch="llama",
        experts_key="num_local_experts",
        norm_topk=True,
        needs_experts=True,
        block_fix=_unpermute_qk,
    ),
    renames=(
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    ),
)
