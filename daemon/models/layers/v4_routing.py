"""DeepSeek-V4's MoE routing and its clamped SwiGLU.

Router scores are sqrt(softplus(logits)). A learned layer picks its top-k experts on score +
correction bias; a hash layer (the first ``num_hash_layers`` of V4) takes them from a fixed
token id -> experts table (``tid2eid``). Either way the weights are the chosen experts' unbiased
scores, renormalised to sum 1 (+ 1e-20) and times ``routed_scaling_factor`` (V4 always
renormalises, whatever ``norm_topk_prob`` says).

Routed and shared experts use a clamped SwiGLU: silu(min(gate, limit)) * clamp(up, -limit,
limit). Not GPT-OSS's clamped form (``experts.banks.Activation.GPTOSS``: (up + 1) * gate *
sigmoid(alpha * gate)); the routed experts' backends compute it as
``experts.banks.Activation.SWIGLU_CLAMP``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import Linear, param, project


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x.float()).sqrt()


def _normalised(scores: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    w = scores.gather(1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * scale


def route_sqrtsoftplus(
    logits: torch.Tensor, score_bias: torch.Tensor, top_k: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, K], weights [T, K] fp32), chosen on score + bias."""
    scores = sqrt_softplus(logits)
    ids = torch.topk(scores + score_bias.float(), top_k, dim=-1).indices
    return ids, _normalised(scores, ids, scale)


def route_hash(
    logits: torch.Tensor, token_ids: torch.Tensor, tid2eid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing: the experts of each token id from ``tid2eid`` [vocab, K]; weights from the
    router's scores as in `route_sqrtsoftplus`."""
    ids = tid2eid.index_select(0, token_ids).long()
    return ids, _normalised(sqrt_softplus(logits), ids, scale)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class V4Router(nn.Module):
    """The router of one MoE layer: ``weight`` [E, hidden] and either ``score_bias`` [E] (learned
    layers) or ``tid2eid`` [vocab, K] (hash layers)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        scale: float,
        dtype: torch.dtype,
        hash_vocab: int = 0,
    ) -> None:
        super().__init__()
        self.top_k, self.scale = top_k, scale
        self.weight = param(num_experts, hidden, dtype=dtype)
        self.score_bias: nn.Parameter | None = None
        self.tid2eid: torch.Tensor | None
        if hash_vocab:  # a table, not a weight: a buffer (the loader fills integer buffers)
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, top_k, dtype=torch.int64))
        else:
            self.tid2eid = None
            self.score_bias = param(num_experts, dtype=torch.float32)

    @property
    def is_hash(self) -> bool:
        return self.tid2eid is not None

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden], token_ids [T] -> (ids [T, K], weights [T, K] fp32)."""
        logits = F.linear(x.to(self.weight.dtype), self.weight).float()
        if self.tid2eid is not None:
            return route_hash(logits, token_ids, self.tid2eid, self.scale)
        assert self.score_bias is not None
        return route_sqrtsoftplus(logits, self.score_bias, self.top_k, self.scale)


class ClampedMLP(nn.Module):
    """down(clamped_swiglu(gate(x), up(x))): V4's shared expert."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = Linear(hidden, inter, dtype)
        self.up_proj = Linear(hidden, inter, dtype)
        self.down_proj = Linear(inter, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, (self.gate_proj, self.up_proj))
        return self.down_proj(clamped_swiglu(gate, up, self.limit))
