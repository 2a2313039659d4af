"""Softmax attention over the paged KV pool.

Covers every family we serve: GQA, optional per-head or full q/k RMSNorm (Qwen3 / OLMoE),
q/k/v/o biases and attention sinks (GPT-OSS), sliding windows, QKV clipping (OLMoE) and the
sigmoid output gate of Qwen3.5 (q_proj emits [q_h, gate_h] per head).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ...native import dense_native
from ...runtime import staging
from ..batch import ForwardBatch, SeqChunk
from ..config import ModelConfig
from .common import Linear, RMSNorm, param, project
from .rope import Rope

# Queries per attention block in prefill: bounds the [heads, block, context] score tensor.
_Q_BLOCK = 512

# Prompt chunks (2 rows or more) on the CPU: the native tiled causal kernel reads K/V from the
# pages in place (native/dense/prefill_attention.h) where `dense_native.prefill_usable` holds (the
# extension built, the pool on the host, head dim a multiple of 16); elsewhere the pages are
# gathered and `attend` runs. Off (tests compare the two): always the torch path.
native_prefill = True

# Decode attention where the native CPU kernel does not apply (the KV pool on a device):
#   "torch"   each sequence's pages gathered with torch ops, then `attend` (the default);
#   "triton"  one launch of the batched paged decode kernel (kernels/paged_attention.py, the
#             custom op ftkernels::paged_decode_attention) for every decode row of the batch,
#             reading K/V in place through a device page table.
# The default stays "torch" until a GPU run of tests/gpu/check.sh has verified the kernel (its
# backends_triton step runs the backend equality tests with the kernel on). Process-wide: the
# daemon's ``attention_kernel`` setting (config.py; the same FREETOKEN_ATTENTION_KERNEL
# environment variable) through `set_decode_kernel` when it loads a model; a process that builds
# LLMs itself (tests) starts from that environment variable. The same switch selects the Gated
# DeltaNet kernels on the device, decode step and chunked prefill (models/layers/deltanet.py,
# kernels/deltanet.py).
DECODE_KERNELS = ("torch", "triton")
DECODE_KERNEL_ENV = "FREETOKEN_ATTENTION_KERNEL"
_decode_kernel = os.environ.get(DECODE_KERNEL_ENV) or "torch"
if _decode_kernel not in DECODE_KERNELS:
    raise ValueError(
        f"{DECODE_KERNEL_ENV}={_decode_kernel!r}: choose one of {', '.join(DECODE_KERNELS)}"
    )


# where "triton" applies: a GPU (and the fake CUDA device, where the op's fake impl runs); on
# the host the native kernel or the torch path serve (tests add "cpu": the Triton interpreter)
_KERNEL_DEVICES = ("cuda",)


def set_decode_kernel(name: str) -> str:
    """Select the device decode attention (``DECODE_KERNELS``); returns the previous one."""
    global _decode_kernel
    if name not in DECODE_KERNELS:
        raise ValueError(f"decode kernel {name!r}: choose one of {', '.join(DECODE_KERNELS)}")
    old, _decode_kernel = _decode_kernel, name
    return old


def decode_kernel() -> str:
    """The device decode attention in use: "torch" or "triton"."""
    return _decode_kernel


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries at positions [q_start, q_start + n) over keys [0, c).

    q [n, heads, d], k/v [c, kv_heads, d] (fp32) -> [n, heads, d]. With ``window`` a query at
    position i sees keys j with i - window < j <= i. ``sinks`` [heads] adds one learned logit per
    head to the softmax denominator (GPT-OSS).
    """
    n, heads, _ = q.shape
    c = k.shape[0]
    if n == 1 and q_start == c - 1 and sinks is None and (window is None or c <= window):
        return _attend_last(q, k, v, scale)
    groups = heads // k.shape[1]
    qpos = torch.arange(q_start, q_start + n, device=q.device).unsqueeze(1)
    kpos = torch.arange(c, device=q.device).unsqueeze(0)
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    if sinks is None:
        # 4-d [1, heads, n, d] with enable_gqa: torch's fused CPU kernel, K/V never repeated per
        # head (512 x 512, 32/4 heads: 117 vs 278 ms for the 3-d repeated form, 2 threads). A
        # prompt's chunk after a cached context is compute-bound here: 256 queries over 3256
        # keys, d 128, 2 threads on Zen 4: 90 ms = 151 GFLOP/s, 85% of torch's own fp32 GEMM
        # there (2048^3: 177 GFLOP/s); no mask 84 ms, a float mask 88, bf16 inputs 92. More
        # needs bf16 dot products.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
    kh = k.repeat_interleave(groups, dim=1).transpose(0, 1)  # [heads, c, d]
    vh = v.repeat_interleave(groups, dim=1).transpose(0, 1)
    qh = q.transpose(0, 1)  # [heads, n, d]
    scores = (qh @ kh.transpose(1, 2)) * scale  # [heads, n, c]
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().view(heads, 1, 1).expand(heads, n, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return (probs @ vh).transpose(0, 1)


def _attend_last(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend` for one query that sees every key (decode): q [1, heads, d], k/v [c, kv_heads, d].

    The query heads of a KV group share one matmul against that group's keys, so nothing is
    repeated per head and no mask is built: 4 small ops instead of SDPA's masked math path
    (measured 0.14 vs 5.1 ms at c = 300, one thread).
    """
    _, heads, d = q.shape
    kv_heads = k.shape[1]
    qg = q.view(kv_heads, heads // kv_heads, d)  # heads h = group * (heads / kv_heads) + j
    scores = torch.bmm(qg, k.permute(1, 2, 0)) * scale  # [kv_heads, group, c]
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, v.transpose(0, 1)).view(1, heads, d)


class _DecodeTables:
    """The decode rows of one forward batch for the native decode attention, built once per batch
    (every attention layer of the step shares them): rows [n] of the flat batch, lens [n] keys
    including the row's own, tables [n, max_pages] int32 page tables (zero-padded)."""

    def __init__(self, batch: ForwardBatch) -> None:
        chunks = [ch for ch in batch.chunks if ch.length == 1]
        self.chunks: list[SeqChunk] = chunks
        self.rows = torch.tensor([ch.start for ch in chunks], dtype=torch.int32)
        self.lens = torch.tensor([ch.context_len + 1 for ch in chunks], dtype=torch.int32)
        pages = [batch.kv.pages_for(ch.context_len + 1) for ch in chunks]
        self.tables = torch.zeros(len(chunks), max(pages, default=0), dtype=torch.int32)
        for i, (ch, n) in enumerate(zip(chunks, pages, strict=True)):
            self.tables[i, :n] = torch.tensor(ch.state.pages[:n], dtype=torch.int32)


class _PrefillTables:
    """The prompt chunks (2 rows or more) of one forward batch for the native prefill attention,
    built once per batch: rows, lens, pos [n] (first row, rows, position of the first row) and
    tables [n, max_pages] int32 page tables (zero-padded)."""

    def __init__(self, batch: ForwardBatch) -> None:
        chunks = [ch for ch in batch.chunks if ch.length > 1]
        self.n = len(chunks)
        self.rows = torch.tensor([ch.start for ch in chunks], dtype=torch.int32)
        self.lens = torch.tensor([ch.length for ch in chunks], dtype=torch.int32)
        self.pos = torch.tensor([ch.context_len for ch in chunks], dtype=torch.int32)
        pages = [batch.kv.pages_for(ch.context_len + ch.length) for ch in chunks]
        self.tables = torch.zeros(self.n, max(pages, default=0), dtype=torch.int32)
        for i, (ch, n) in enumerate(zip(chunks, pages, strict=True)):
            self.tables[i, :n] = torch.tensor(ch.state.pages[:n], dtype=torch.int32)


def _prefill_rows(batch: ForwardBatch) -> _PrefillTables:
    """The batch's `_PrefillTables`, built by its first attention layer."""
    tables = batch.derived.get("prefill_tables")
    if tables is None:
        tables = batch.derived["prefill_tables"] = _PrefillTables(batch)
    return tables  # type: ignore[no-any-return]


class _KernelTables:
    """The decode rows of one forward batch for the paged decode kernel, on the pool's device:
    rows [n], lens [n] (keys including the row's own) and tables [n, max_pages] int32, sent in
    one asynchronous copy (runtime/staging) once per batch; ``max_len`` the longest, on the host."""

    def __init__(self, batch: ForwardBatch, device: torch.device) -> None:
        chunks = [ch for ch in batch.chunks if ch.length == 1]
        self.n = len(chunks)
        self.all_rows = self.n == sum(ch.length for ch in batch.chunks)  # rows 0..n-1 in order
        pages = [batch.kv.pages_for(ch.context_len + 1) for ch in chunks]
        width = max(pages, default=0)
        self.max_len = max((ch.context_len + 1 for ch in chunks), default=0)
        host = torch.zeros(self.n, 2 + width, dtype=torch.int32)
        for i, (ch, n) in enumerate(zip(chunks, pages, strict=True)):
            host[i, 0], host[i, 1] = ch.start, ch.context_len + 1
            host[i, 2 : 2 + n] = torch.tensor(ch.state.pages[:n], dtype=torch.int32)
        meta = staging.to_device(host, device)
        self.rows, self.lens, self.tables = meta[:, 0], meta[:, 1], meta[:, 2:]
        self.index = self.rows.long()


def _kernel_rows(batch: ForwardBatch, device: torch.device) -> _KernelTables:
    """The batch's `_KernelTables`, built by its first attention layer."""
    tables = batch.derived.get("decode_kernel_tables")
    if tables is None:
        tables = batch.derived["decode_kernel_tables"] = _KernelTables(batch, device)
    return tables  # type: ignore[no-any-return]


def _decode_rows(batch: ForwardBatch) -> _DecodeTables:
    """The batch's `_DecodeTables`, built by its first attention layer."""
    tables = batch.derived.get("decode_tables")
    if tables is None:
        tables = batch.derived["decode_tables"] = _DecodeTables(batch)
    return tables  # type: ignore[no-any-return]


def paged_attention(
    batch: ForwardBatch,
    kv_layer: int,
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every row of the batch over its sequence's pages of pool layer ``kv_layer``.

    q [N, heads, d] contiguous; ``kv`` the rows' (K, V) [N, kv_heads, d], written to the pages
    first, or None for a layer that reads another layer's KV. On the CPU, prompt chunks go through
    one native tiled call and decode rows through another, both reading the pages in place (no
    gather, no fp32 copy of the context); elsewhere prompt rows attend over the pages read back
    (fp32, in query blocks). Returns [N, heads, d].
    """
    if batch.decode is not None:
        return _static_decode(batch, kv_layer, q, kv, scale, window, sinks)
    out = torch.empty_like(q)
    kp, vp = batch.kv.k[kv_layer], batch.kv.v[kv_layer]
    native = dense_native.attention_usable(q, kp, vp)
    prefill = native and native_prefill and dense_native.prefill_usable(q, kp, vp)
    kernel = not native and _decode_kernel == "triton" and q.device.type in _KERNEL_DEVICES
    for ch in batch.chunks:
        end = ch.context_len + ch.length
        if kv is not None:
            rows = slice(ch.start, ch.start + ch.length)
            batch.kv.write(kv_layer, ch.state.pages, ch.context_len, kv[0][rows], kv[1][rows])
        if (native or kernel) and ch.length == 1 or prefill:
            continue
        first = 0 if window is None else max(0, ch.context_len - window + 1)
        table = ch.state.pages if ch.table is None else ch.table
        kc, vc = batch.kv.read(kv_layer, table, end, start=first)
        kc, vc = kc.float(), vc.float()
        for b0 in range(0, ch.length, _Q_BLOCK):
            b1 = min(ch.length, b0 + _Q_BLOCK)
            out[ch.start + b0 : ch.start + b1] = attend(
                q[ch.start + b0 : ch.start + b1], kc, vc, ch.context_len + b0 - first, scale,
                window, sinks,
            )  # fmt: skip
    if prefill and any(ch.length > 1 for ch in batch.chunks):
        pre = _prefill_rows(batch)
        dense_native.prefill_attention(
            q, kp, vp, pre.tables, pre.rows, pre.lens, pre.pos, scale, window, sinks, out
        )
    if native:
        dec = _decode_rows(batch)
        if dec.chunks:
            dense_native.decode_attention(
                q, kp, vp, dec.tables, dec.lens, scale, window, sinks, dec.rows, out
            )
    elif kernel and any(ch.length == 1 for ch in batch.chunks):
        # deferred: triton (the ftkernels GPU kernels)
        from ftkernels.ops import paged_decode_attention as decode_op

        kt = _kernel_rows(batch, q.device)
        res = decode_op(q, kp, vp, kt.tables, kt.lens, kt.rows, kt.max_len, scale, window, sinks)
        if kt.all_rows:
            return res
        out.index_copy_(0, kt.index, res)
    return out


def _static_decode(
    batch: ForwardBatch,
    kv_layer: int,
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """`paged_attention` of a decode batch in static form (``batch.decode``): the rows' K/V go
    to their pool rows by one device-side index copy, and the attention reads a page table of
    fixed width masked by ``lens`` on the device, so no shape, index or bound depends on a
    context length (a captured CUDA graph replays it for any step of the same batch and
    width)."""
    dm = batch.decode
    assert dm is not None
    kp, vp = batch.kv.k[kv_layer], batch.kv.v[kv_layer]
    if kv is not None:
        kp.view(-1, *kp.shape[2:]).index_copy_(0, dm.slots, kv[0].to(kp.dtype))
        vp.view(-1, *vp.shape[2:]).index_copy_(0, dm.slots, kv[1].to(vp.dtype))
    if _decode_kernel == "triton" and q.device.type in _KERNEL_DEVICES:
        # deferred: triton (the ftkernels GPU kernels)
        from ftkernels.ops import paged_decode_attention as decode_op

        return decode_op(  # type: ignore[no-any-return]
            q, kp, vp, dm.tables, dm.lens, dm.rows, dm.max_len, scale, window, sinks
        )
    return masked_decode(q, kp, vp, dm.tables, dm.lens, scale, window, sinks)


# `masked_decode` gathers its rows' keys and values into fp32 work buffers; it takes the keys in
# chunks of whole pages so that those buffers stay within this many bytes at any batch and
# context. Gathered whole, batch 8 over 131072 keys of 8 KV heads of dim 64 took about 8 GB a
# layer: more than a card keeps free, so the capture of the widest graph ran out of memory. The
# slot budget keeps what they take free (``decode_workspace_bytes``, models/model.py). A
# context whose buffers fit runs as one chunk (the ops of the whole form, unchanged); a longer
# one costs a few small ops per chunk (at 256 MiB, batch 8 over 131072 keys of GPT-OSS's
# attention, 64 query heads on 8 KV heads of dim 64: 24 chunks), where the gather itself reads
# gigabytes.
DECODE_WORKSPACE_BYTES = 256 << 20


def _key_bytes(heads: int, kv_heads: int, head_dim: int, kv_itemsize: int) -> int:
    """Work bytes of one key of one row in `masked_decode` at their peak, an upper bound over
    its phases: the keys (or values) gathered in the pool's dtype, in fp32 and the contiguous
    copy an einsum makes of them (2 x 4 bytes an element), and the [heads] scores, their
    masked or exponentiated copy and the probabilities (with a sink: concatenated, then copied
    by the einsum) in fp32, plus the row's mask and key position."""
    e = kv_heads * head_dim
    return e * (kv_itemsize + 8) + 12 * heads + 16


def _fixed_bytes(rows: int, heads: int, head_dim: int) -> int:
    """Work bytes of `masked_decode` that do not grow with the keys: the fp32 queries, the
    running maxima, sums and weighted values (old and new), the output."""
    return 4 * rows * heads * (4 * head_dim + 6)


def decode_chunk_pages(
    rows: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    kv_itemsize: int,
    workspace: int = DECODE_WORKSPACE_BYTES,
) -> int:
    """Pages of keys `masked_decode` takes at a time for ``rows`` rows: the most whose work
    buffers fit ``workspace`` bytes, at least one."""
    per_page = rows * page_size * _key_bytes(heads, kv_heads, head_dim, kv_itemsize)
    return max(1, (workspace - _fixed_bytes(rows, heads, head_dim)) // per_page)


def decode_workspace_bytes(
    rows: int,
    keys: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    kv_itemsize: int,
    workspace: int = DECODE_WORKSPACE_BYTES,
) -> int:
    """Device bytes `masked_decode`'s work buffers take at peak for ``rows`` rows over page
    tables of ``keys`` keys (``heads`` query heads over ``kv_heads`` KV heads of ``head_dim``,
    pool entries of ``kv_itemsize`` bytes): ``workspace`` at most, unless a single page of
    every row takes more. The Triton decode kernel's workspace is far smaller: this bounds
    both."""
    pages = -(-keys // page_size)
    step = min(pages, decode_chunk_pages(rows, heads, kv_heads, head_dim, page_size,
                                         kv_itemsize, workspace))  # fmt: skip
    per_key = _key_bytes(heads, kv_heads, head_dim, kv_itemsize)
    return rows * step * page_size * per_key + _fixed_bytes(rows, heads, head_dim)


def masked_decode(
    q: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    workspace: int = DECODE_WORKSPACE_BYTES,
) -> torch.Tensor:
    """Decode attention in torch over whole page tables, keys past ``lens`` masked: q [B,
    heads, d]; kp, vp [pages, page_size, kv_heads, d]; tables [B, W]; lens [B] keys per row
    (its own included) -> [B, heads, d] in q's dtype. The same math as `attend` for one query
    at position lens - 1 (window and sinks included); every shape is fixed by (B, W). The keys
    go in chunks of pages whose work buffers fit ``workspace`` bytes (`decode_chunk_pages`)."""
    b, heads, d = q.shape
    kv_heads, page = kp.shape[2], kp.shape[1]
    qg = q.float().view(b, kv_heads, heads // kv_heads, d)
    ln = lens.long().view(b, 1)
    step = decode_chunk_pages(b, heads, kv_heads, d, page, kp.element_size(), workspace)
    if step >= tables.shape[1]:
        out = _decode_whole(qg, kp, vp, tables, ln, scale, window, sinks)
    else:
        out = _decode_chunked(qg, kp, vp, tables, ln, scale, window, sinks, step)
    return out.reshape(b, heads, d).to(q.dtype)


def _scores_and_values(
    qg: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    idx: torch.Tensor,
    first: int,
    ln: torch.Tensor,
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores [B, kv_heads, group, L] of queries ``qg`` [B, kv_heads, group, d] over the
    keys of pages ``idx`` [B, P] (keys ``first`` .. ``first`` + L of each row), -inf where the
    row does not see the key, and those keys' values [B, L, kv_heads, d] in fp32, 0 there."""
    b = qg.shape[0]
    k = kp[idx].flatten(1, 2).float()  # [B, L, kv_heads, d], L = P * page_size
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale
    del k  # the values' buffers take its place
    pos = torch.arange(first, first + scores.shape[-1], device=qg.device)
    allowed = pos.view(1, -1) < ln  # [B, L]
    if window is not None:
        allowed = allowed & (pos.view(1, -1) >= ln - window)
    scores = scores.masked_fill(~allowed.view(b, 1, 1, -1), float("-inf"))
    # keys past lens are pages never written (any bits, NaN among them): 0 * NaN is NaN
    v = vp[idx].flatten(1, 2).float().masked_fill(~allowed.view(b, -1, 1, 1), 0.0)
    return scores, v


def _decode_whole(
    qg: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    tables: torch.Tensor,
    ln: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """`masked_decode` over every key at once: [B, kv_heads, group, d] fp32."""
    scores, v = _scores_and_values(qg, kp, vp, tables.long(), 0, ln, scale, window)
    if sinks is not None:
        sink = sinks.float().view(1, *qg.shape[1:3], 1).expand(qg.shape[0], -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    del scores
    return torch.einsum("bkgl,blkd->bkgd", probs, v)


def _decode_chunked(
    qg: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    tables: torch.Tensor,
    ln: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    step: int,
) -> torch.Tensor:
    """`masked_decode` over ``step`` pages of keys at a time, their softmax combined online (a
    running maximum rescales the sum and the weighted values kept so far): [B, kv_heads,
    group, d] fp32. The maximum starts finite, so a chunk a row sees no key of adds zeros
    instead of NaN (exp(-inf - -inf))."""
    stat = (*qg.shape[:3], 1)
    m = torch.full(stat, torch.finfo(torch.float32).min, device=qg.device)
    total = torch.zeros(stat, device=qg.device)
    acc = torch.zeros_like(qg)
    page = kp.shape[1]
    for p0 in range(0, tables.shape[1], step):
        idx = tables[:, p0 : p0 + step].long()
        scores, v = _scores_and_values(qg, kp, vp, idx, p0 * page, ln, scale, window)
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new)
        del scores
        total = total * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.einsum("bkgl,blkd->bkgd", p, v)
        m = m_new
        del p, v  # not alive beside the next chunk's keys
    if sinks is not None:  # one more logit per head in the denominator
        sink = sinks.float().view(1, *qg.shape[1:3], 1)
        m_new = torch.maximum(m, sink)
        alpha = torch.exp(m - m_new)
        total = total * alpha + torch.exp(sink - m_new)
        acc = acc * alpha
    return acc / total


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kv_layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, kvh, d, hid = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = h, kvh, d
        self.kv_layer = kv_layer
        self.gated = cfg.attention_output_gate
        bias = cfg.attention_bias
        self.q_proj = Linear(hid, h * d * (2 if self.gated else 1), dtype, bias)
        self.k_proj = Linear(hid, kvh * d, dtype, bias)
        self.v_proj = Linear(hid, kvh * d, dtype, bias)
        self.o_proj = Linear(h * d, hid, dtype, cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, cfg.norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(h * d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(kvh * d, cfg.rms_norm_eps, dtype)
        self.sinks = param(h, dtype=dtype) if cfg.attention_sinks else None
        self.window = cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else None
        self.clip = cfg.clip_qkv
        self.scale = d**-0.5

    def _qkv(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        n = x.shape[0]
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        gate = None
        if self.gated:  # per head: [q_h (d), gate_h (d)]
            qg = q.view(n, self.heads, 2 * self.head_dim)
            q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :].reshape(n, -1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.reshape(n, self.heads, self.head_dim)
        k = k.reshape(n, self.kv_heads, self.head_dim)
        v = v.reshape(n, self.kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, gate

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rope: Rope, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        q, k, v, gate = self._qkv(x)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        q = q.contiguous()
        out = paged_attention(batch, self.kv_layer, q, (k, v), self.scale, self.window, self.sinks)
        o = out.reshape(x.shape[0], -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)
