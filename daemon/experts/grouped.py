"""Routed-expert sum on the accelerator, grouped by expert, with one host sync per call.

``moe_reference`` learns the experts of a batch with ``unique().tolist()`` and each expert's
routes with ``nonzero``: on a GPU that is a host sync per expert. Here the routes are sorted by
id on the device and the per-expert route counts reach the host in one copy; the host then
walks the experts of a known id range [lo, lo + n) (a layer's experts, a prefill buffer, the
slot pool) slicing the sorted routes. Per-route terms and their summation order are those of
``moe_reference``, so results match it exactly.

On the fake device the counts carry no data: the call plans with the routing that needs the
largest work buffers, every token routed to the same K experts (each of them gets all T
tokens), which is also the cheapest to simulate (K experts walked, not the whole range).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .banks import ActivationSpec, ExpertBanks, activate


def host_counts(counts: torch.Tensor, tokens: int, top_k: int) -> list[int]:
    """``counts`` [n] int64 on the device -> a host list (one device -> host copy). On the fake
    device: the worst case for work buffers, ``tokens`` routes to each of the first ``top_k``."""
    host = counts.cpu()
    if isinstance(host, FakeTensor):
        n = host.numel()
        return [tokens if i < top_k else 0 for i in range(n)]
    return [int(c) for c in host.tolist()]


def moe_grouped(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    banks: ExpertBanks,
    act: ActivationSpec,
    lo: int,
    n: int,
) -> torch.Tensor:
    """x [T, H]; ids [T, K] int bank rows (outside [lo, lo + n), e.g. -1: skipped); weights
    [T, K]; every tensor and bank on one device. Returns [T, H] fp32."""
    t, k = ids.shape
    h_dim = x.shape[1]
    flat = ids.reshape(-1).long()  # [N] route r = token r // K, rank r % K
    local = flat - lo
    valid = (local >= 0) & (local < n)
    key = torch.where(valid, local, torch.full_like(local, n))  # skipped routes sort last
    order = torch.argsort(key, stable=True)  # [N] routes grouped by expert, row-major inside
    counts = torch.zeros(n + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    sizes = host_counts(counts[:n], t, k)
    xf = x.float()
    w = weights.reshape(-1).float()
    routed = torch.zeros(t * k, h_dim, dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(sizes):
        if c == 0:
            continue
        sel = order[start : start + c]  # [c] routes of expert lo + e
        start += c
        row = lo + e
        h = xf[sel // k] @ banks.gate_up[row].float().t()
        if banks.gate_up_bias is not None:
            h = h + banks.gate_up_bias[row].float()
        y = activate(h, act) @ banks.down[row].float().t()
        if banks.down_bias is not None:
            y = y + banks.down_bias[row].float()
        routed.index_copy_(0, sel, y * w[sel].unsqueeze(-1))
    return routed.view(t, k, h_dim).sum(dim=1)
