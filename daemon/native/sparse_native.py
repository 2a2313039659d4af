"""Native sparse decode attention and Lightning Indexer on the CPU (`ftdense`,
native/dense/sparse_attention.h): one decode query of DeepSeek Sparse Attention (DeepSeek-V3.2,
GLM-5; models/layers/dsa.py) or of DeepSeek-V4's compressed attention (layers/v4_attention.py).

* `index_topk`: score(p) = sum_h w[h] * relu(scale * q[h] . key(p)) over the keys at positions
  [0, n), then the k best positions, best first, equal scores to the lower position (the order
  of `compressed.select_topk`; the torch reference is `compressed.index_scores` + `select_topk`).
* `sparse_attention`: softmax attention of one query [heads, dk] over a list of rows read in
  place (keys: a row's first dk columns, values its first dv), with optional per-head sinks.

Rows are given as `Rows`: one layer of the paged KV pool with a page table ([num_pages,
page_size, 1, width], position p at page table[p // page_size]) or a contiguous [n, width]
tensor (position p at row p), bf16 or fp32, from a column on. Nothing is gathered or widened
into a copy. The kernels run on dense_native's pool with its ISA: the attention scalar or AVX2 +
FMA, as the decode attention's ("avx512" takes AVX2); the indexer AVX-512, AVX2, emu512 or
scalar, every path the same scores to the bit (each key's score one fixed chain of fused
multiply-adds in its own lane: native/dense/index_impl.h), whatever the thread count.

`usable` is False when the extension is not built or inside ``dense_native.torch_only()`` (the
device code path): callers then keep their torch path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import dense_native

_DTYPES = (torch.float32, torch.bfloat16)


def usable(*tensors: torch.Tensor) -> bool:
    """The native kernels take these tensors: extension built and on, every tensor on the CPU
    in fp32 or bf16, none needing a gradient."""
    return dense_native._on() and all(
        t.device.type == "cpu"
        and t.dtype in _DTYPES
        and not (torch.is_grad_enabled() and t.requires_grad)
        for t in tensors
    )


def isa() -> str:
    """The sparse attention's ISA path ("avx2" or "scalar")."""
    dense_native.ensure_configured()
    return str(dense_native._native.sparse_isa())


def index_isa() -> str:
    """The indexer's ISA path ("avx512", "avx2", "emu512" or "scalar")."""
    dense_native.ensure_configured()
    return str(dense_native._native.index_isa())


def fma_probe(iters: int) -> int:
    """Runs ``iters`` rounds of independent fp32 FMA chains in registers (AVX2) and returns the
    multiply-adds done: timed by the caller, this core's fp32 FMA peak (the indexer's bound)."""
    dense_native.ensure_configured()
    return int(dense_native._native.fma_probe(iters))


@dataclass(frozen=True)
class Rows:
    """Rows addressed by position: ``data`` [num_pages, page_size, 1, width] with ``table``
    (int32 page ids), or [n, width] without; columns from ``col`` on."""

    data: torch.Tensor
    col: int = 0
    table: torch.Tensor | None = None

    def arg(self) -> tuple[int, bool, int, int, int, int, int, int]:
        d, t = self.data, self.table
        if not d.is_contiguous():
            raise ValueError("rows must be contiguous")
        if t is None:
            if d.dim() != 2:
                raise ValueError("rows without a page table must be [n, width]")
            return (d.data_ptr(), d.dtype == torch.bfloat16, d.shape[1], self.col, 0, 0,
                    d.shape[0], 0)  # fmt: skip
        if d.dim() != 4 or d.shape[2] != 1:
            raise ValueError("paged rows must be [num_pages, page_size, 1, width]")
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError("the page table must be a contiguous 1-d int32 tensor")
        pages, ps, _, width = d.shape
        return (d.data_ptr(), d.dtype == torch.bfloat16, width, self.col, t.data_ptr(), ps,
                pages * ps, t.shape[0])  # fmt: skip


def index_topk(
    q: torch.Tensor, w: torch.Tensor, keys: Rows, n: int, k: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [heads, dim], w [heads] (fp32; w carries every factor but ``scale``) against the keys
    at positions [0, n) (``dim`` columns of ``keys``) -> (the min(k, n) best positions [m] int64,
    best first, ties to the lower position; every score [n] fp32)."""
    dense_native.ensure_configured()
    heads, dim = q.shape
    qc, wc = q.float().contiguous(), w.float().contiguous()
    if wc.shape != (heads,):
        raise ValueError(f"w must have shape ({heads},)")
    sel = torch.empty(min(k, n), dtype=torch.int32)
    scores = torch.empty(n)
    dense_native._native.index_topk(
        qc.data_ptr(), wc.data_ptr(), heads, dim, scale, keys.arg(), n, k, sel.data_ptr(),
        scores.data_ptr(),
    )  # fmt: skip
    return sel.long(), scores


@dataclass(frozen=True)
class Segment:
    """Rows of a `sparse_attention` call: ``rows`` at ``positions`` (int tensor), or at
    ``first`` .. ``first + count - 1``."""

    rows: Rows
    positions: torch.Tensor | None = None
    first: int = 0
    count: int = 0


def sparse_attention(
    q: torch.Tensor,
    segments: Sequence[Segment],
    dv: int,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query q [heads, dk] over the segments' rows (keys their first dk
    columns, values their first dv; all bf16 or all fp32), softmax in fp32 with the optional
    per-head sink logits [heads] -> [heads, dv] fp32."""
    dense_native.ensure_configured()
    heads, dk = q.shape
    qc = q.float().contiguous()
    sk = None if sinks is None else sinks.float().contiguous()
    if sk is not None and sk.shape != (heads,):
        raise ValueError(f"sinks must have shape ({heads},)")
    keep = []  # the int32 positions, alive through the call
    args = []
    for s in segments:
        if s.positions is None:
            args.append((s.rows.arg(), 0, s.first, s.count))
        else:
            p = s.positions.to(torch.int32).contiguous()
            keep.append(p)
            args.append((s.rows.arg(), p.data_ptr(), 0, p.numel()))
    out = torch.empty(heads, dv)
    dense_native._native.sparse_attention(
        qc.data_ptr(), heads, dk, dv, scale, args, 0 if sk is None else sk.data_ptr(),
        out.data_ptr(),
    )  # fmt: skip
    del keep
    return out
