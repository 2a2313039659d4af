"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4, shared with its successors).

The residual is ``n`` parallel streams per token, [T, n, D] instead of [T, D]. Around each block
(attention, FFN) a `HyperConnection` reads the streams and produces three mixes from them:

    pre  [T, n]     sigmoid(...) + eps: weights that collapse the streams into the block's input
    post [T, n]     2 * sigmoid(...): how the block's output is spread back onto the streams
    comb [T, n, n]  softmax(...) + eps, then Sinkhorn-Knopp towards a doubly-stochastic matrix:
                    how the old streams carry over, new_k = sum_j comb[j, k] * old_j

All three come from one projection of the RMS-normalised (no weight) flattened streams:
``fn`` [(2 + n) * n, n * D], plus a bias ``base`` and one scale per mix (``scale`` [3]).
`HyperHead` is the final collapse before the model's last norm (a ``pre`` mix only).

Everything here runs in fp32, as the checkpoint keeps these parameters; ``fn`` read from a GGUF
file in a block format stays in its blocks (``qweight``) and is computed as the file's other
block projections are, by the integer-dot kernels on int8 inputs, as llama.cpp computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...native.qlinear_native import QuantWeight
from .common import block_linear, param


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, fp32."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def _mix_logits(flat: torch.Tensor, fn: torch.Tensor, qweight: QuantWeight | None) -> torch.Tensor:
    """flat [T, K] (normalised streams) @ fn^T, fn in fp32 or in GGUF blocks."""
    if qweight is not None:
        return block_linear(flat, qweight)
    return F.linear(flat, fn.float())


def sinkhorn(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp on positive matrices [..., n, n]: first the columns are divided by their
    sums, then ``iters - 1`` rounds of rows then columns, every division by (sum + eps). With
    ``iters`` = the checkpoint's ``hc_sinkhorn_iters`` this is the mixing the model was trained
    with (its result is only close to doubly-stochastic; the exact steps matter)."""
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def expand_streams(h: torch.Tensor, n: int) -> torch.Tensor:
    """[T, D] -> [T, n, D]: every stream a copy (the embedding enters all streams)."""
    return h.unsqueeze(1).repeat(1, n, 1)


def merge_streams(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams after a block: post[t, k] * out[t] + sum_j comb[t, j, k] * streams[t, j].

    streams [T, n, D], out [T, D], post [T, n], comb [T, n, n] -> [T, n, D] fp32. Note the sum
    runs over comb's FIRST stream index (comb transposed): the matrix is not symmetric."""
    carried = torch.matmul(comb.transpose(-1, -2), streams.float())
    return post.unsqueeze(-1) * out.float().unsqueeze(1) + carried


class HyperConnection(nn.Module):
    block_param = "fn"  # a GGUF file's blocks (gguf_loader)
    block_dtype = torch.float32  # widened (``widen_kept_blocks``), fp32 as released

    def __init__(self, n: int, hidden: int, iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.qweight: QuantWeight | None = None
        self.n, self.iters, self.hc_eps, self.norm_eps = n, iters, hc_eps, norm_eps
        self.fn = param((2 + n) * n, n * hidden, dtype=torch.float32)
        self.base = param((2 + n) * n, dtype=torch.float32)
        self.scale = param(3, dtype=torch.float32)

    def mixes(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> pre [T, n], post [T, n], comb [T, n, n] (fp32)."""
        n = self.n
        flat = unweighted_rms_norm(streams.flatten(1), self.norm_eps)
        z = _mix_logits(flat, self.fn, self.qweight)
        bias = self.base.float()
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(z[:, :n] * s_pre + bias[:n]) + self.hc_eps
        post = 2.0 * torch.sigmoid(z[:, n : 2 * n] * s_post + bias[n : 2 * n])
        logits = z[:, 2 * n :] * s_comb + bias[2 * n :]
        comb = torch.softmax(logits.view(-1, n, n), dim=-1) + self.hc_eps
        return pre, post, sinkhorn(comb, self.iters, self.hc_eps)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (block input [T, D], post [T, n], comb [T, n, n]), fp32."""
        pre, post, comb = self.mixes(streams)
        x = (pre.unsqueeze(-1) * streams.float()).sum(1)
        return x, post, comb


class HyperHead(nn.Module):
    """The last collapse of the streams: sum_k (sigmoid(fn . norm(flat) * scale + base) + eps)_k
    * stream_k."""

    block_param = "fn"
    block_dtype = torch.float32

    def __init__(self, n: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.qweight: QuantWeight | None = None
        self.n, self.hc_eps, self.norm_eps = n, hc_eps, norm_eps
        self.fn = param(n, n * hidden, dtype=torch.float32)
        self.base = param(n, dtype=torch.float32)
        self.scale = param(1, dtype=torch.float32)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, n, D] -> [T, D] fp32."""
        flat = unweighted_rms_norm(streams.flatten(1), self.norm_eps)
        z = _mix_logits(flat, self.fn, self.qweight)
        pre = torch.sigmoid(z * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams.float()).sum(1)
