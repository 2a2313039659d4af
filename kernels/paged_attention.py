"""Batched paged decode attention: one query token per sequence over its pages of the KV pool.

Layout (freetokend.kv.pool): one layer's K and V are [num_pages, page_size, kv_heads, head_dim]
(contiguous, bf16 or fp32); a sequence's token at position p lives in page
``tables[b, p // page_size]`` at row ``p % page_size``. Query b is row ``rows[b]`` of
q [N, heads, head_dim] and sits at position ``lens[b] - 1`` (its own key already written), so
it sees keys j with max(0, lens[b] - window) <= j < lens[b]. Query head h reads KV head
h // (heads / kv_heads) (GQA, as ``repeat_interleave`` in models/layers/attention.py). With
``sinks`` [heads] one learned logit per head joins the softmax denominator (GPT-OSS) and
contributes no value.

Two launches (split-context decoding):
- ``_split_kernel``, grid (B, kv_heads, splits): the query heads of one KV group against one
  slice of the context, in blocks of BLOCK_N keys with an online softmax, fp32 throughout
  (fp32 ``tl.dot`` in IEEE precision: no TF32); writes the slice's running max, sum of
  exponentials and unnormalised output to an fp32 workspace.
- ``_reduce_kernel``, grid (B, heads): merges the slices (and the sink) into the output.
The number of splits fills the card at small batches (about TARGET_PROGRAMS programs) and is
never more than the context's blocks, so a long context at batch 1 is spread over the SMs.

``paged_decode_attention_reference`` computes the same in plain torch (a loop over sequences).
Both run in the Triton interpreter on CPU tensors (tests, ``interp.for_device``).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .interp import for_device

TARGET_PROGRAMS = 1024  # split programs aimed at when the batch alone does not fill the card
SPLIT_BLOCK = 16  # splits merged per step of the reduce kernel
NUM_WARPS = 4
# no software pipelining of the gathered K/V loads: with Triton's default 3 stages the split
# kernel spills at d 128 on sm_86+ (255 registers, 2.8 KiB of stack)
NUM_STAGES = 1


def block_n(head_dim: int) -> int:
    """Keys per inner step: 32 up to head dim 128, fewer for wider heads. The register budget
    decides (compile test, fp32 IEEE dots, one stage): 64 keys at d 128 spill on every target,
    32 take 168-190 registers; at d 64, 32 keys take 54, 64 keys 166."""
    return max(16, min(32, 4096 // triton.next_power_of_2(head_dim)))


def splits_for(batch: int, kv_heads: int, max_keys: int, head_dim: int) -> tuple[int, int]:
    """(splits, keys per split): enough programs to fill a card, whole blocks per split."""
    bn = block_n(head_dim)
    blocks = triton.cdiv(max(1, max_keys), bn)
    want = max(1, min(blocks, triton.cdiv(TARGET_PROGRAMS, max(1, batch * kv_heads))))
    part = triton.cdiv(blocks, want) * bn
    return triton.cdiv(max(1, max_keys), part), part


def workspace_shapes(
    batch: int, heads: int, head_dim: int, splits: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The fp32 workspace: unnormalised outputs [B, heads, splits, d], (max, sum) [.., 2]."""
    return (batch, heads, splits, head_dim), (batch, heads, splits, 2)


# the runtime integers are never specialised (a 1-page table or a single split would otherwise
# compile another kernel mid-serving)
@triton.jit(do_not_specialize=["max_pages", "window", "part"])
def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, rows_ptr, wo_ptr, wml_ptr,
                  max_pages, window, part, scale,
                  H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                  G: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    num_splits = tl.num_programs(2)
    length = tl.load(lens_ptr + b)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(length - window, 0)
    lo = start + s * part
    hi = tl.minimum(lo + part, length)
    row = tl.load(rows_ptr + b).to(tl.int64)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gm = g < G
    dm = d < D
    heads = kvh * G + g
    qmask = gm[:, None] & dm[None, :]
    q = tl.load(q_ptr + (row * H + heads)[:, None] * D + d[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    table = table_ptr + b.to(tl.int64) * max_pages
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pm = pos < hi
        page = tl.load(table + pos // PAGE, mask=pm, other=0).to(tl.int64)
        tok = page * PAGE + (pos % PAGE)
        off = (tok * KVH + kvh)[:, None] * D + d[None, :]
        kvmask = pm[:, None] & dm[None, :]
        k = tl.load(k_ptr + off, mask=kvmask, other=0.0).to(tl.float32)
        sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G_PAD, BLOCK_N]
        sc = tl.where(pm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + off, mask=kvmask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    # an empty slice (a short sequence of a long batch) leaves max -inf, sum 0, output 0
    slot = (b * H + heads).to(tl.int64) * num_splits + s
    tl.store(wo_ptr + slot[:, None] * D + d[None, :], acc, mask=qmask)
    tl.store(wml_ptr + slot * 2, m_i, mask=gm)
    tl.store(wml_ptr + slot * 2 + 1, l_i, mask=gm)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(wo_ptr, wml_ptr, sinks_ptr, out_ptr, num_splits,
                   H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   SB: tl.constexpr, HAS_SINKS: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b * H + h).to(tl.int64) * num_splits
    d = tl.arange(0, D_PAD)
    dm = d < D
    mv = tl.full([SB], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, SB):
        si = s0 + tl.arange(0, SB)
        mv = tl.maximum(mv, tl.load(wml_ptr + (base + si) * 2, mask=si < num_splits,
                                    other=float("-inf")))  # fmt: skip
    m = tl.max(mv, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m = tl.maximum(m, sink)
    lv = tl.zeros([SB], dtype=tl.float32)
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    for s0 in range(0, num_splits, SB):
        si = s0 + tl.arange(0, SB)
        sm = si < num_splits
        ms = tl.load(wml_ptr + (base + si) * 2, mask=sm, other=float("-inf"))
        ls = tl.load(wml_ptr + (base + si) * 2 + 1, mask=sm, other=0.0)
        w = tl.exp(ms - m)  # an empty slice: exp(-inf) = 0
        lv += ls * w
        o = tl.load(wo_ptr + (base + si)[:, None] * D + d[None, :],
                    mask=sm[:, None] & dm[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(o * w[:, None], axis=0)
    total = tl.sum(lv, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - m)
    out = acc / total
    tl.store(out_ptr + (b * H + h).to(tl.int64) * D + d, out.to(out_ptr.dtype.element_ty),
             mask=dm)  # fmt: skip


def _check(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    rows: torch.Tensor,
    sinks: torch.Tensor | None,
) -> None:
    if q.dim() != 3 or k_pages.dim() != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"q [N, heads, d] and K/V pages [pages, page_size, kv_heads, d] expected, got "
            f"{tuple(q.shape)}, {tuple(k_pages.shape)}, {tuple(v_pages.shape)}"
        )
    heads, d = q.shape[1], q.shape[2]
    kvh = k_pages.shape[2]
    if k_pages.shape[3] != d or heads % kvh:
        raise ValueError(
            f"{heads} q heads of dim {d} over {kvh} KV heads of dim {k_pages.shape[3]}"
        )
    n = rows.shape[0]
    if lens.shape != (n,) or tables.dim() != 2 or tables.shape[0] != n:
        raise ValueError("rows, lens and tables must describe the same number of queries")
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"sinks must have shape ({heads},), got {tuple(sinks.shape)}")


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    rows: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of queries ``q[rows]`` over their pages; returns [n, heads, d] in q's
    dtype. Everything stays on the device (no host read).

    q [N, heads, d]; k_pages, v_pages [num_pages, page_size, kv_heads, d] contiguous; tables
    [n, max_pages] int32 (unused entries any valid page); lens [n] int32 keys per query
    (including its own, >= 1); rows [n] int32 rows of q; ``max_len`` at least max(lens) (sizes
    the grid: known on the host); ``window`` keys seen at most; sinks [heads] or None.
    """
    _check(q, k_pages, v_pages, tables, lens, rows, sinks)
    n, heads, d = int(rows.shape[0]), int(q.shape[1]), int(q.shape[2])
    page, kvh = int(k_pages.shape[1]), int(k_pages.shape[2])
    dev = q.device
    out = torch.empty(n, heads, d, dtype=q.dtype, device=dev)
    if n == 0:
        return out
    keys = max_len if window is None else min(max_len, window)
    splits, part = splits_for(n, kvh, keys, d)
    wo_shape, wml_shape = workspace_shapes(n, heads, d, splits)
    wo = torch.empty(wo_shape, dtype=torch.float32, device=dev)
    wml = torch.empty(wml_shape, dtype=torch.float32, device=dev)
    g = heads // kvh
    qc = q.contiguous()
    ti, li, ri = (t.to(torch.int32).contiguous() for t in (tables, lens, rows))
    mod = for_device(sys.modules[__name__], dev)
    mod._split_kernel[(n, kvh, splits)](
        qc, k_pages, v_pages, ti, li, ri, wo, wml,
        int(ti.shape[1]), 0 if window is None else int(window), part, float(scale),
        H=heads, KVH=kvh, D=d, PAGE=page, G=g, G_PAD=max(16, triton.next_power_of_2(g)),
        D_PAD=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n(d),
        HAS_WINDOW=window is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    sk = sinks.contiguous() if sinks is not None else wml  # any pointer: unused
    mod._reduce_kernel[(n, heads)](
        wo, wml, sk, out, splits,
        H=heads, D=d, D_PAD=max(16, triton.next_power_of_2(d)), SB=SPLIT_BLOCK,
        HAS_SINKS=sinks is not None, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    rows: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_decode_attention`` in plain torch: each query's visible keys gathered from its
    pages, one fp32 softmax over the logits (and the sink). Reads lens/tables on the host."""
    _check(q, k_pages, v_pages, tables, lens, rows, sinks)
    n, heads, d = int(rows.shape[0]), int(q.shape[1]), int(q.shape[2])
    page, kvh = int(k_pages.shape[1]), int(k_pages.shape[2])
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    lens_h, rows_h, tables_h = lens.tolist(), rows.tolist(), tables.long().cpu()
    for i in range(n):
        length = int(lens_h[i])
        if length > max_len:
            raise ValueError(f"query {i} has {length} keys, over max_len {max_len}")
        first = 0 if window is None else max(0, length - window)
        pos = torch.arange(first, length)
        pg = tables_h[i][pos // page].to(k_pages.device)
        at = (pos % page).to(k_pages.device)
        k = k_pages[pg, at].float().repeat_interleave(heads // kvh, dim=1)  # [keys, heads, d]
        v = v_pages[pg, at].float().repeat_interleave(heads // kvh, dim=1)
        logits = torch.einsum("hd,khd->hk", q[int(rows_h[i])].float(), k) * scale
        if sinks is not None:
            logits = torch.cat([logits, sinks.float().view(heads, 1)], dim=1)
        probs = torch.softmax(logits, dim=1)[:, : pos.numel()]
        out[i] = torch.einsum("hk,khd->hd", probs, v).to(q.dtype)
    return out
