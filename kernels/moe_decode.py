"""Triton kernels of the offload backend's decode step that need no host sync (ARCHITECTURE §4.2).

The slot cache's decode kernel leaves its result on the device: slot ids per route and a
fixed-shape copy list with a valid count. These kernels consume them there:

- ``copy_rows``: executes the copy list (dst[dst_idx[i]] <- src[src_idx[i]] for i < count). On
  CUDA ``src`` is the host pool in pinned, mapped memory: the SMs read it over PCIe (zero-copy),
  so the count never has to reach the host.
- ``moe_decode``: the routed-expert sum for a few tokens, one program per (route, block of
  outputs); a route with slot -1 contributes 0 without reading weights. Gate/up GEMV with the
  activation fused, then the down GEMV scaled by the gate weight; the K terms of a token are
  summed in route order, like ``moe_reference``.

Both run in the Triton interpreter on CPU tensors (tests). No ``tl.dot``: these are GEMVs, and
the interpreter's bf16 ``tl.dot`` is wrong anyway; products are taken in fp32.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .interp import for_device

COPY_BLOCK = 1024  # 4-byte words per program and loop step
COPY_PROGRAMS = 2048  # programs of the copy grid at most (each loops over work items)
BLOCK_I = 32  # gate/up rows (of each half) per program
BLOCK_H = 128  # hidden columns per inner step
BLOCK_N = 32  # down rows per program
BLOCK_K = 128  # intermediate columns per inner step


@triton.jit
def _copy_rows_kernel(dst_ptr, src_ptr, dst_idx_ptr, src_idx_ptr, count_ptr, row_words,
                      BLOCK: tl.constexpr):  # fmt: skip
    # Work item w = copy * blocks_per_row + block, for the `count` valid copies only; the
    # programs of the 1-D grid take the items in turn, so the grid never depends on the row
    # length or on the (device-side) count, and no axis meets CUDA's 65,535 limit.
    nblk = tl.cdiv(row_words, BLOCK)
    total = tl.load(count_ptr).to(tl.int64) * nblk
    for w in range(tl.program_id(0).to(tl.int64), total, tl.num_programs(0)):
        i = w // nblk
        offs = (w % nblk) * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(src_idx_ptr + i).to(tl.int64)
        d = tl.load(dst_idx_ptr + i).to(tl.int64)
        m = offs < row_words
        v = tl.load(src_ptr + s * row_words + offs, mask=m)
        tl.store(dst_ptr + d * row_words + offs, v, mask=m)


def copy_grid(max_copies: int, row_words: int) -> tuple[int]:
    """Launch grid of ``copy_rows``: enough programs for every block of every listed copy, at
    most COPY_PROGRAMS (a few per SM on any card); the count itself stays on the device."""
    return (max(1, min(COPY_PROGRAMS, max_copies * triton.cdiv(row_words, COPY_BLOCK))),)


def _rows_as_words(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N, words]: int32 words where the row size allows, else bytes."""
    flat = t.reshape(t.shape[0], -1)
    raw = flat.view(torch.uint8)
    return raw.view(torch.int32) if raw.shape[1] % 4 == 0 else raw


def copy_rows(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_idx: torch.Tensor,
    src_idx: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """dst[dst_idx[i]] <- src[src_idx[i]] for i < count[0]; indices and count stay on the device.

    dst [N_dst, ...], src [N_src, ...] same dtype and row shape, both contiguous
    dst_idx, src_idx [C] int32 (entries at or past count are ignored); count [1] int32
    """
    if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        raise ValueError(
            f"row mismatch: {dst.dtype}{tuple(dst.shape)} vs {src.dtype}{tuple(src.shape)}"
        )
    d, s = _rows_as_words(dst), _rows_as_words(src)
    n = int(dst_idx.shape[0])
    if n == 0 or d.shape[1] == 0:
        return
    kern = for_device(sys.modules[__name__], d.device)._copy_rows_kernel
    kern[copy_grid(n, d.shape[1])](d, s, dst_idx, src_idx, count, d.shape[1], BLOCK=COPY_BLOCK)


def copy_rows_reference(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_idx: torch.Tensor,
    src_idx: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """Plain-torch ``copy_rows`` (reads the count on the host)."""
    n = int(count.reshape(-1)[0])
    if n:
        dst[dst_idx[:n].long()] = src[src_idx[:n].long().to(src.device)].to(dst.device)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, slot_ptr, h_ptr, H, INTER, K, alpha, limit,
                    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                    BI: tl.constexpr, BH: tl.constexpr):  # fmt: skip
    # h[r, i] = act(gate_up[slot] @ x[t])[i] for route r = t * K + k, rows i of this program
    r = tl.program_id(0)
    rows = tl.program_id(1) * BI + tl.arange(0, BI)
    slot = tl.load(slot_ptr + r)
    valid = slot >= 0
    base = w_ptr + tl.maximum(slot, 0).to(tl.int64) * (2 * INTER * H)
    xrow = x_ptr + (r // K).to(tl.int64) * H
    rmask = rows < tl.where(valid, INTER, 0)  # a skipped route reads no weights
    acc_g = tl.zeros([BI], dtype=tl.float32)
    acc_u = tl.zeros([BI], dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        cmask = cols < H
        xv = tl.load(xrow + cols, mask=cmask, other=0.0).to(tl.float32)
        m2 = rmask[:, None] & cmask[None, :]
        wg = tl.load(base + rows[:, None] * H + cols[None, :], mask=m2, other=0.0)
        wu = tl.load(base + (rows[:, None] + INTER) * H + cols[None, :], mask=m2, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
    if HAS_BIAS:
        bbase = b_ptr + tl.maximum(slot, 0).to(tl.int64) * (2 * INTER)
        acc_g += tl.load(bbase + rows, mask=rmask, other=0.0).to(tl.float32)
        acc_u += tl.load(bbase + INTER + rows, mask=rmask, other=0.0).to(tl.float32)
    # ACT: 0 SiLU, 1 GPT-OSS clamped SwiGLU, 2 gelu_pytorch_tanh, 3 DeepSeek-V4's clamped
    # SwiGLU (Activation's values)
    if ACT == 1:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    elif ACT == 2:  # 0.5 g (1 + tanh(z)) = g sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        z = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
        h = acc_g * tl.sigmoid(2.0 * z) * acc_u
    elif ACT == 3:  # silu(min(g, limit)) * clamp(u, -limit, limit)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = g * tl.sigmoid(g) * u
    else:
        h = acc_g * tl.sigmoid(acc_g) * acc_u
    h = tl.where(valid, h, 0.0)
    tl.store(h_ptr + r.to(tl.int64) * INTER + rows, h, mask=rows < INTER)


@triton.jit
def _down_kernel(h_ptr, w_ptr, b_ptr, slot_ptr, gate_ptr, y_ptr, H, INTER,
                 HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    # y[r, n] = gate[r] * (down[slot] @ h[r] + bias)[n] for the rows n of this program
    r = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    slot = tl.load(slot_ptr + r)
    valid = slot >= 0
    base = w_ptr + tl.maximum(slot, 0).to(tl.int64) * (H * INTER)
    hrow = h_ptr + r.to(tl.int64) * INTER
    rmask = rows < tl.where(valid, H, 0)  # a skipped route reads no weights
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, INTER, BK):
        cols = k0 + tl.arange(0, BK)
        cmask = cols < INTER
        hv = tl.load(hrow + cols, mask=cmask, other=0.0)
        w = tl.load(base + rows[:, None] * INTER + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(w.to(tl.float32) * hv[None, :], axis=1)
    if HAS_BIAS:
        bias = tl.load(b_ptr + tl.maximum(slot, 0).to(tl.int64) * H + rows, mask=rmask, other=0.0)
        acc += bias.to(tl.float32)
    acc = tl.where(valid, acc * tl.load(gate_ptr + r).to(tl.float32), 0.0)
    tl.store(y_ptr + r.to(tl.int64) * H + rows, acc, mask=rows < H)


def decode_grids(routes: int, h_dim: int, i_dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Launch grids of the gate/up and down kernels: (route, block of output rows); routes on
    x (CUDA limit 2**31 - 1), row blocks on y (limit 65,535: I / BLOCK_I, H / BLOCK_N)."""
    return (routes, triton.cdiv(i_dim, BLOCK_I)), (routes, triton.cdiv(h_dim, BLOCK_N))


def moe_decode(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    act: int,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """Routed-expert sum from slot banks, slot ids read on the device; returns [T, H] fp32.

    x [T, H]; slot_ids, weights [T, K] (-1 = skip); gate_up [S, 2I, H] (gate rows then up rows);
    down [S, H, I]; biases [S, 2I] and [S, H] or None; ``act`` the expert activation as
    `Activation`'s value (0 SiLU, 1 GPT-OSS, 2 gelu-tanh).
    """
    t, k = slot_ids.shape
    h_dim, i_dim = int(down.shape[1]), int(down.shape[2])
    r = t * k
    dev = x.device
    xs = x.contiguous()
    slots = slot_ids.reshape(-1).to(torch.int32).contiguous()
    gates = weights.reshape(-1).float().contiguous()
    hidden = torch.empty(r, i_dim, dtype=torch.float32, device=dev)
    y = torch.empty(r, h_dim, dtype=torch.float32, device=dev)
    if r == 0:
        return torch.zeros(t, h_dim, dtype=torch.float32, device=dev)
    gub = gate_up_bias if gate_up_bias is not None else gates  # any pointer: unused
    db = down_bias if down_bias is not None else gates
    mod = for_device(sys.modules[__name__], dev)
    gate_up_grid, down_grid = decode_grids(r, h_dim, i_dim)
    mod._gate_up_kernel[gate_up_grid](
        xs, gate_up, gub, slots, hidden, h_dim, i_dim, k, float(alpha), float(limit),
        HAS_BIAS=gate_up_bias is not None, ACT=int(act), BI=BLOCK_I, BH=BLOCK_H,
    )  # fmt: skip
    mod._down_kernel[down_grid](
        hidden, down, db, slots, gates, y, h_dim, i_dim,
        HAS_BIAS=down_bias is not None, BN=BLOCK_N, BK=BLOCK_K,
    )  # fmt: skip
    return y.view(t, k, h_dim).sum(dim=1)
