"""Sparse MoE block: router, routed experts (through the MoE backend), optional shared expert."""

from __future__ import annotations

import torch
from torch import nn

from ...engine.batch import ForwardBatch
from ..config import ModelConfig
from .common import DenseMLP, Linear


def route(
    logits: torch.Tensor, top_k: int, softmax_first: bool, renorm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, K], weights [T, K] fp32).

    softmax_first: softmax over all experts, take the top k, optionally renormalise (Qwen, Mixtral,
    OLMoE). Otherwise: top k of the logits, softmax over those k (GPT-OSS).
    """
    logits = logits.float()
    if softmax_first:
        probs = torch.softmax(logits, dim=-1)
        w, ids = torch.topk(probs, top_k, dim=-1)
        if renorm:
            w = w / w.sum(-1, keepdim=True)
        return ids, w
    top, ids = torch.topk(logits, top_k, dim=-1)
    return ids, torch.softmax(top, dim=-1)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe_index = moe_index
        self.top_k = cfg.top_k
        self.softmax_first = cfg.family != "gpt_oss"
        self.renorm = cfg.norm_topk_prob
        self.router = Linear(cfg.hidden_size, cfg.num_experts, dtype, bias=cfg.router_bias)
        self.shared_expert: DenseMLP | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(
                cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype
            )
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        ids, w = route(self.router(x), self.top_k, self.softmax_first, self.renorm)
        out = batch.moe.forward(self.moe_index, x, ids, w)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
