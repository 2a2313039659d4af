"""Sparse MoE block: router, routed experts (through the MoE backend), optional shared expert."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..batch import ForwardBatch
from ..config import ModelConfig
from .common import DenseMLP, Linear, param


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


def route_sigmoid_group(
    logits: torch.Tensor,
    score_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renorm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; experts are chosen on score + correction bias, only inside the
    ``topk_group`` groups whose two best biased scores sum highest; weights are the unbiased
    scores of the chosen experts (optionally renormalised) times ``scale``."""
    scores = torch.sigmoid(logits.float())
    choice = scores + score_bias.float()
    t, e = choice.shape
    groups = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.topk(topk_group, dim=-1).indices, True)
    choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if renorm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scale


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe_index = moe_index
        self.top_k = cfg.top_k
        self.kind = cfg.router_kind
        self.renorm = cfg.norm_topk_prob
        router_dtype = torch.float32 if cfg.router_fp32 else dtype
        self.router = Linear(cfg.hidden_size, cfg.num_experts, router_dtype, bias=cfg.router_bias)
        self.group = (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        if self.kind == "sigmoid_group":
            self.score_bias = param(cfg.num_experts, dtype=torch.float32)
        self.shared_expert: DenseMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(
                cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype
            )
            if cfg.shared_expert_gated:
                self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice for x [T, H]: (expert ids [T, K], weights [T, K] fp32)."""
        logits = self.router(x)
        if self.kind == "sigmoid_group":
            n_group, topk_group, scale = self.group
            return route_sigmoid_group(
                logits, self.score_bias, self.top_k, n_group, topk_group, self.renorm, scale
            )
        return route(logits, self.top_k, self.kind == "softmax", self.renorm)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        ids, w = self.select(x)
        out = batch.moe.forward(self.moe_index, x, ids, w)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def router_predictor(model: nn.Module) -> Callable[[int, torch.Tensor], torch.Tensor | None]:
    """predict(moe layer, x) -> the expert ids [T, K] that MoE layer's router chooses for x, an
    earlier layer's MoE input (the residual stream changes little from one layer to the next):
    the disk tier reads them ahead (experts/disk_tier.py). None for a layer of no router here."""
    routers = {m.moe_index: m for m in model.modules() if isinstance(m, SparseMoE)}

    def predict(layer: int, x: torch.Tensor) -> torch.Tensor | None:
        m = routers.get(layer)
        return None if m is None else m.select(x)[0]

    return predict
