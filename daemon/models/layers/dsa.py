"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): multi-head latent attention (``mla.py``)
whose keys are chosen per query by a Lightning Indexer.

The indexer keeps one key per token, beside the MLA latent in the same KV pool row (the row is
[latent kv_lora_rank | rotated key qk_rope_head_dim | index key index_head_dim]), so the prefix
cache, preemption and recompute treat index keys exactly as KV:

    k_s    = rope(LayerNorm(x_s W_k))                                   [index_head_dim]
    q(t,h) = rope((q_res(t) W_qb)_h)                                    [index_heads, index_head_dim]
    score(t, s) = sum_h (x_t W_w)_h / sqrt(heads) * relu(q(t,h) . k_s) / sqrt(index_head_dim)

(``compressed.index_scores``, shared with DeepSeek-V4), rope on the first qk_rope_head_dim
channels of a head, half-split pairs (DeepSeek-V3.2) or interleaved ones (GLM-5). A query at
position p attends over the ``index_topk`` best of keys 0..p (itself only when it is among them;
all of them while p + 1 <= index_topk). Equal scores are broken towards the EARLIER position
(``compressed.select_topk``): transformers' ``torch.topk`` leaves ties to the kernel, whose
choice changes with the row's length, and with few indexer heads many scores are exactly 0
(every head's ReLU zero).

GLM-5's "shared" layers have no indexer (and no index key in their pool rows): they reuse the
selection of the last layer before them that has one, kept for the step in ``batch.derived``.

Prefill chunks attend over their whole context with the selection as a mask; a decode row (a
chunk of one query) gathers and expands only its selected latents. On the CPU with the native
extension (`sparse_native`) a decode row instead scores the index keys in place in the pool
(`sparse_native.index_topk`, the same tie-break) and attends over the selected pool rows in
absorbed form, without expanding them: the query's non-rotated part is folded into the latent
space per head, q_lat[h] = q_nope[h] W_uk[h] (W_uk[h] the head's key rows of kv_b_proj), the
kernel attends with [q_lat | q_rope] over the rows' [latent | rotated key] and returns the
softmax-weighted latent per head, and out[h] = W_uv[h] latent_out[h]. The same sums in another
order: equal to the torch path within fp32 rounding (tests/test_dsa.py). The per-head products
run in fp32 on kv_b_proj's weight (views of an fp32 weight; a bf16 or quantized one is widened
once per layer: GLM-5, 58 MB a layer beside its 29 MB of bf16), where expanding the 2048 chosen
latents would take 2048 x 512 x 28672 multiply-adds a token and layer. A GGUF file's
attn_k_b / attn_v_b in a block format stay in their blocks (``mla.py``): prefill and decode
then run absorbed with both per-head products in the integer-dot kernels, no float copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...native import sparse_native
from ..batch import ForwardBatch
from ..config import ModelConfig
from .common import Linear, param
from .compressed import index_scores, select_topk
from .mla import MLAttention, causal_mask, masked_attention
from .rope import Rope

# batch.derived key: the last indexer layer's selection per chunk ([n, <= topk] key positions
# with -1 padding, or None where the chunk's queries see at most index_topk keys: all of them)
SELECTION = "dsa_selection"

# bytes of the [queries, heads, keys] fp32 dot products the indexer scores at a time
_SCORE_BYTES = 64 << 20


def pool_row_widths(cfg: ModelConfig) -> tuple[int, ...]:
    """Per attention layer: the pool row width, the MLA latent plus, in a layer with its own
    indexer, its index key."""
    base = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    shared = cfg.index_shared or (False,) * cfg.num_layers
    return tuple(base + (0 if s else cfg.index_head_dim) for s in shared)


def rope_head(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x [N, heads, D] fp32; cos, sin [N, r / 2] -> x with its FIRST r channels rotated,
    interleaved pairs (2i, 2i + 1) or half-split pairs (i, i + r / 2) by angle i. The rotated
    channels come out in half-split order either way (the same order for queries and keys, so
    their dot products are those of the pairs in place)."""
    r = 2 * cos.shape[-1]
    if interleaved:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
    else:
        a, b = x[..., : r // 2], x[..., r // 2 : r]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((a * c - b * s, b * c + a * s, x[..., r:]), dim=-1)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, in fp32 (the indexer's key norm)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.bias = param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight.float(), self.bias.float()
        return F.layer_norm(x.float(), (x.shape[-1],), w, b, self.eps)


class LightningIndexer(nn.Module):
    """The indexer's weights (checkpoint names under ``self_attn.indexer.``) and its keys,
    queries and per-head weights."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.interleaved = cfg.index_rope_interleaved
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.dim, dtype)
        self.wk = Linear(cfg.hidden_size, self.dim, dtype)
        self.k_norm = LayerNorm(self.dim, 1e-6, dtype)
        # fp32 whatever the checkpoint's dtype, as transformers keeps it
        self.weights_proj = Linear(cfg.hidden_size, self.heads, torch.float32)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, index_head_dim] fp32."""
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        return rope_head(k, cos, sin, self.interleaved).squeeze(1)

    def queries(self, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q_res [n, q_lora_rank] -> [n, heads, index_head_dim] fp32."""
        q = self.wq_b(q_res).view(q_res.shape[0], self.heads, self.dim)
        return rope_head(q, cos, sin, self.interleaved)

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, heads] fp32 (before the 1 / sqrt(heads))."""
        return self.weights_proj(x.float())

    def select(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, q_start: int
    ) -> torch.Tensor:
        """Queries q [n, heads, D] (at positions q_start..) with weights w [n, heads] over the
        context's keys [c, D] -> [n, min(topk, c)] selected positions, best first, -1 padding
        where a query sees fewer keys. Scored in blocks of queries (bounded work buffers)."""
        n, c = q.shape[0], keys.shape[0]
        step = max(1, _SCORE_BYTES // (4 * self.heads * max(c, 1)))
        out = []
        for b0 in range(0, n, step):
            b1 = min(n, b0 + step)
            s = index_scores(q[b0:b1], keys, w[b0:b1])
            s = s.masked_fill(~causal_mask(b1 - b0, c, q_start + b0, q.device), float("-inf"))
            out.append(select_topk(s, self.topk))
        return out[0] if len(out) == 1 else torch.cat(out)


class SparseMLAttention(MLAttention):
    """MLA over the keys the indexer selects (module docstring)."""

    def __init__(self, cfg: ModelConfig, layer: int, kv_layer: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, kv_layer, dtype)
        assert cfg.q_lora_rank, "DSA queries are compressed"
        self.topk = cfg.index_topk
        shared = bool(cfg.index_shared and cfg.index_shared[layer])
        self.indexer = None if shared else LightningIndexer(cfg, dtype)
        # kv_b_proj's per-head key and value blocks in fp32 for the absorbed native decode
        # (`_absorbed`), made at the first such decode
        self._uk_uv: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rope: Rope, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        q, packed, q_res = self.project(x, rope, cos, sin)
        ix = self.indexer
        sels: list[torch.Tensor | None]
        if ix is not None:
            assert q_res is not None
            packed = torch.cat([packed, ix.keys(x, cos, sin).unsqueeze(1)], dim=-1)
            iq, iw = ix.queries(q_res, cos, sin), ix.weights(x)
            sels = []
        else:  # a shared layer: the last indexer layer's selection
            sels = batch.derived[SELECTION]
        base = self.kvr + self.dr
        out = torch.empty(n, self.heads, self.dv, device=x.device)
        pool = batch.kv.k[self.kv_layer]
        native = sparse_native.usable(x, pool)
        for i, ch in enumerate(batch.chunks):
            rows = slice(ch.start, ch.start + ch.length)
            end = ch.context_len + ch.length
            batch.kv.write(self.kv_layer, ch.state.pages, ch.context_len, packed[rows], None)
            table = ch.state.pages if ch.table is None else ch.table
            sel: torch.Tensor | None = None
            if native and ch.length == 1:
                t32 = _table32(batch, i, table)
                if ix is not None:
                    if end > self.topk:
                        sel = self._select_native(iq[ch.start], iw[ch.start], pool, t32, end)
                    sels.append(sel)
                else:
                    sel = sels[i]
                out[ch.start] = self._attend_native(q[ch.start], pool, t32, sel, end)
                continue
            kc = batch.kv.read(self.kv_layer, table, end)[0][:, 0].float()
            if ix is not None:
                if end > self.topk:  # else every query sees at most topk keys: all of them
                    sel = ix.select(iq[rows], iw[rows], kc[:, base:], ch.context_len)
                sels.append(sel)
            else:
                sel = sels[i]
            out[rows] = self._attend(q[rows], kc, sel, ch.context_len)
        if ix is not None:
            batch.derived[SELECTION] = sels
        return self.o_proj(out.reshape(n, -1))

    def _select_native(
        self, q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, end: int
    ) -> torch.Tensor:
        """One decode query's selection [1, topk] over the index keys of positions [0, end),
        read in place from the pool rows (`LightningIndexer.select`'s, natively)."""
        ix = self.indexer
        assert ix is not None
        keys = sparse_native.Rows(pool, self.kvr + self.dr, table)
        sel, _ = sparse_native.index_topk(q, w * ix.heads**-0.5, keys, end, self.topk, ix.dim**-0.5)
        return sel.unsqueeze(0)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's key blocks [heads, dn, kvr] and value blocks [heads, dv, kvr], fp32 (views
        of an fp32 weight; a copy of any other, made once)."""
        if self._uk_uv is None:
            lin = self.kv_b_proj
            assert lin is not None
            w = lin.weight if lin.qweight is None else lin.qweight.dequantize()
            w = w.detach().float().view(self.heads, self.dn + self.dv, self.kvr)
            self._uk_uv = (w[:, : self.dn], w[:, self.dn :])
        return self._uk_uv

    def _attend_native(
        self,
        q: torch.Tensor,
        pool: torch.Tensor,
        table: torch.Tensor,
        sel: torch.Tensor | None,
        end: int,
    ) -> torch.Tensor:
        """One decode query q [heads, dn + dr] over the pool rows of ``sel`` [1, k] (None: every
        position < end), absorbed (module docstring) -> [heads, dv]."""
        blocks = self.kv_b_blocks is not None
        if blocks:
            q_lat = self.absorb_query(q[None, :, : self.dn])[0]
        else:
            uk, uv = self._absorbed()
            q_lat = torch.bmm(q[:, None, : self.dn], uk).squeeze(1)  # [heads, kvr]
        qa = torch.cat([q_lat, q[:, self.dn :]], dim=-1)
        rows = sparse_native.Rows(pool, 0, table)
        seg = sparse_native.Segment(rows, None, 0, end) if sel is None else (
            sparse_native.Segment(rows, sel[0])
        )  # fmt: skip
        lat = sparse_native.sparse_attention(qa, [seg], self.kvr, self.scale)  # [heads, kvr]
        if blocks:
            return self.values_from_latent(lat[None])[0]
        return torch.bmm(uv, lat.unsqueeze(-1)).squeeze(-1)

    def _attend(
        self, q: torch.Tensor, kc: torch.Tensor, sel: torch.Tensor | None, q_start: int
    ) -> torch.Tensor:
        """q [n, heads, dn + dr] at positions q_start.. over pool rows kc [c, width] fp32,
        restricted to ``sel`` [n, k] (None: every earlier key)."""
        n, c = q.shape[0], kc.shape[0]
        if self.kv_b_blocks is not None:  # absorbed, over the rows it may see
            if sel is None:
                return self.absorbed_attention(q, kc, causal_mask(n, c, q_start, q.device))
            if n == 1:
                return self.absorbed_attention(q, kc[sel[0].clamp(min=0)], sel >= 0)
            chosen = torch.zeros(n, c, dtype=torch.bool, device=q.device)
            chosen.scatter_(1, sel.clamp(min=0), True)
            allowed = chosen & causal_mask(n, c, q_start, q.device)
            return self.absorbed_attention(q, kc, allowed)
        if sel is None:
            k, v = self.expand(kc)
            return masked_attention(q, k, v, causal_mask(n, c, q_start, q.device), self.scale)
        if n == 1:  # decode: expand only the selected rows
            k, v = self.expand(kc[sel[0].clamp(min=0)])
            return masked_attention(q, k, v, sel >= 0, self.scale)
        # -1 padding marks key 0, which such a query (seeing fewer than topk keys, all selected)
        # sees anyway
        chosen = torch.zeros(n, c, dtype=torch.bool, device=q.device)
        chosen.scatter_(1, sel.clamp(min=0), True)
        k, v = self.expand(kc)
        return masked_attention(q, k, v, chosen & causal_mask(n, c, q_start, q.device), self.scale)


def _table32(batch: ForwardBatch, i: int, table: list[int] | torch.Tensor) -> torch.Tensor:
    """Chunk i's page table as the native kernels take it (int32), made once per step."""
    tables = batch.derived.setdefault("dsa_tables32", {})
    t = tables.get(i)
    if t is None:
        t = tables[i] = torch.as_tensor(table).to(torch.int32).contiguous()
    return t  # type: ignore[no-any-return]
