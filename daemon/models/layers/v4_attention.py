"""DeepSeek-V4 attention: one shared KV head, sliding window, optional compressed entries.

Per token:

    q_res = q_a_norm(x W_qa)                         (also the indexer's query input)
    q     = rms(q_res W_qb per head), no weight;      k = kv_norm(x W_kv), ONE head, read as K and V
    q, k  = rope on their trailing rope_dim channels (`compressed.rotate_tail`)

A query at position p attends, with one learned sink logit per head in the softmax
(softmax over [logits, sink], the sink's share dropped), to

    * the keys of positions (p - window, p]                         (every layer)
    * HCA layers: every compressed entry it sees, [0, (p + 1) // rate)
    * CSA layers: the indexer's top-k of those entries

Keys and entries are also the values, so each output carries their rope; the rope slice of the
output is rotated back by -p (the output then depends on relative positions only). The output
projection is grouped and low-rank: the heads' [H * D] output splits into ``o_groups`` groups,
each projected to ``o_lora_rank`` by its own matrix (``o_a_proj``), then mixed by ``o_b_proj``.

Sliding layers use the "main" rope; CSA / HCA layers use the compress rope (its own theta, and
YaRN) for queries, keys, entries and indexer alike: the model passes the layer's rope.

A decode step (one token) on the CPU with the native extension runs the indexer's scoring and
top-k and the attention over the window's keys plus the chosen (CSA) or all (HCA) entries in
native code (`sparse_native`), reading the state's tensors in place. Prefill and other devices
take the torch path: on CSA layers each query reads its window and its chosen entries only
(`V4Attention._attend_selected`: blocks of queries, the chosen entries gathered; at 16k tokens
the top-512 of 4096 entries, 1/8 of the rows), on sliding and HCA layers every key and entry
masked to those seen (`_attend_masked`, also CSA's reference with ``masked_prefill``).

`V4AttentionState` is one sequence's state in one layer: the last window - 1 keys and the
compressor / indexer states (`compressed.CompressorState`). The engine keeps the compressed
entries in the paged pool (models/deepseek_v4_model.py): its states are ``detached``, their size
bounded whatever the sequence's length (``state_bytes(n, entries=False)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...native import dense_native, sparse_native
from ...native.qlinear_native import QuantWeight
from .common import Linear, RMSNorm, block_linear, param, project
from .compressed import Compressor, CompressorState, Indexer, rotate_tail, visible_entries
from .hyper import unweighted_rms_norm
from .rope import Rope

# gathered elements (query x selected entry x channel) of one `_attend_selected` block: 64
# queries at V4-Flash's index_topk 512 x head_dim 512 (64 MiB of fp32 rows)
SELECTED_BLOCK = 1 << 24


class GroupedLinear(nn.Module):
    """x [N, G, d_in] -> [N, G * d_out]: group g through its own block of ``weight``
    [G * d_out, d_in] (rows [g * d_out, (g + 1) * d_out)). fp32 out. A GGUF file's block weight
    stays in its blocks (``qweight``), each group's rows computed by the integer-dot kernels, as
    llama.cpp computes ``attn_output_a``."""

    block_param = "weight"  # a GGUF file's blocks (``qweight``, gguf_loader)

    def __init__(self, d_in: int, d_out: int, groups: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.groups, self.d_out = groups, d_out
        self.weight = param(groups * d_out, d_in, dtype=dtype)
        self.qweight: QuantWeight | None = None
        self._group_qw: list[QuantWeight] | None = None  # qweight's rows per group

    def _groups_q(self) -> list[QuantWeight]:
        if self._group_qw is None:
            assert self.qweight is not None
            raw, n = self.qweight.gguf_raw(), self.d_out
            cols, fmt = self.qweight.cols, self.qweight.fmt
            self._group_qw = [
                QuantWeight.from_raw(raw[g * n : (g + 1) * n], fmt, cols)
                for g in range(self.groups)
            ]
        return self._group_qw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:  # each group's rows from the blocks, int8 inputs
            ys = [block_linear(x[:, g], qw) for g, qw in enumerate(self._groups_q())]
            return torch.cat(ys, dim=-1)
        w = self.weight.view(self.groups, self.d_out, -1)
        if dense_native.usable(x[:, 0], self.weight):
            # bf16 weights on the CPU: each group's block through the native dense kernel
            # (x.to(bf16) @ w^T accumulated in fp32, as `Linear`); torch's bf16 einsum has no
            # fast kernel on CPUs without bf16 instructions (measured 5.6x the time of the
            # same multiply-adds in Q8_0 blocks on an AVX2 Zen 3)
            return torch.cat([dense_native.linear(x[:, g], w[g]) for g in range(self.groups)], 1)
        y = torch.einsum("ngi,goi->ngo", x.to(w.dtype), w)
        return y.reshape(x.shape[0], -1).float()


@dataclass
class V4AttentionState:
    window: torch.Tensor  # [w, head_dim] fp32 keys (= values) of the last w <= window - 1 tokens
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def detached(self) -> V4AttentionState:
        """The state without the compressors' entries (kept elsewhere: `CompressorState.detached`)."""
        return V4AttentionState(
            self.window,
            None if self.compressor is None else self.compressor.detached(),
            None if self.indexer is None else self.indexer.detached(),
        )

    def clone(self) -> V4AttentionState:
        return V4AttentionState(
            self.window.clone(),
            None if self.compressor is None else self.compressor.clone(),
            None if self.indexer is None else self.indexer.clone(),
        )

    @property
    def nbytes(self) -> int:
        n = self.window.numel() * self.window.element_size()
        return n + sum(c.nbytes for c in (self.compressor, self.indexer) if c is not None)


@dataclass(frozen=True)
class IndexerShape:
    heads: int
    head_dim: int
    topk: int


class V4Attention(nn.Module):
    def __init__(
        self,
        *,
        hidden: int,
        heads: int,
        head_dim: int,
        q_lora_rank: int,
        o_groups: int,
        o_lora_rank: int,
        window: int,
        eps: float,
        dtype: torch.dtype,
        compress_rate: int = 0,
        indexer: IndexerShape | None = None,
    ) -> None:
        """compress_rate 0: sliding only. With a rate: HCA without ``indexer``, CSA with it."""
        super().__init__()
        # CSA prefill: False reads each query's selected entries (`_attend_selected`, blocks of
        # at most ``selected_block`` gathered elements); True the masked reference
        self.masked_prefill = False
        self.selected_block = SELECTED_BLOCK
        self.heads, self.head_dim, self.window, self.eps = heads, head_dim, window, eps
        self.groups = o_groups
        self.scale = head_dim**-0.5
        self.q_a_proj = Linear(hidden, q_lora_rank, dtype)
        self.q_a_norm = RMSNorm(q_lora_rank, eps, torch.float32)
        self.q_b_proj = Linear(q_lora_rank, heads * head_dim, dtype)
        self.kv_proj = Linear(hidden, head_dim, dtype)
        self.kv_norm = RMSNorm(head_dim, eps, torch.float32)
        self.o_a_proj = GroupedLinear(heads * head_dim // o_groups, o_lora_rank, o_groups, dtype)
        self.o_b_proj = Linear(o_groups * o_lora_rank, hidden, dtype)
        self.sinks = param(heads, dtype=torch.float32)
        self.rate = compress_rate
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if compress_rate:
            overlap = indexer is not None
            self.compressor = Compressor(hidden, head_dim, compress_rate, overlap, eps, dtype)
            if indexer is not None:
                self.indexer = Indexer(
                    hidden,
                    q_lora_rank,
                    indexer.heads,
                    indexer.head_dim,
                    compress_rate,
                    indexer.topk,
                    eps,
                    dtype,
                )

    def empty_state(self, device: torch.device | None = None) -> V4AttentionState:
        return V4AttentionState(
            torch.zeros(0, self.head_dim, device=device),
            None if self.compressor is None else self.compressor.empty_state(device),
            None if self.indexer is None else self.indexer.compressor.empty_state(device),
        )

    def compressors(self) -> list[Compressor]:
        """The layer's compressors: its own (CSA, HCA), then its indexer's (CSA)."""
        out = [] if self.compressor is None else [self.compressor]
        return out + ([] if self.indexer is None else [self.indexer.compressor])

    def state_bytes(self, tokens: int, entries: bool = True) -> int:
        """Bytes of the layer's `V4AttentionState` after ``tokens`` tokens (its ``nbytes``):
        the window's keys and the compressors' states (without their entries: ``detached``)."""
        window = 4 * min(tokens, self.window - 1) * self.head_dim
        return window + sum(c.state_bytes(tokens, entries) for c in self.compressors())

    def max_fixed_bytes(self) -> int:
        """The most the state holds beside its entries, whatever the length: a full window of
        keys and each compressor's open window and overlap: ``state_bytes(L, entries=False)``
        at any L (the entries add one row of ``dim`` per ``rate`` tokens per compressor)."""
        window = 4 * (self.window - 1) * self.head_dim
        return window + sum(c.max_open_bytes() for c in self.compressors())

    def forward(
        self,
        x: torch.Tensor,
        start: int,
        state: V4AttentionState,
        rope: Rope,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, V4AttentionState]:
        """x [N, hidden]: the sequence's tokens at positions start .. start + N - 1 (normed);
        cos, sin: ``rope`` at those positions. -> (output [N, hidden] fp32, the new state)."""
        n, dev = x.shape[0], x.device
        qpos = start + torch.arange(n, device=dev)
        qa, kv = project(x, (self.q_a_proj, self.kv_proj))
        q_res = self.q_a_norm(qa)
        q = self.q_b_proj(q_res).view(n, self.heads, self.head_dim)
        q = rotate_tail(unweighted_rms_norm(q, self.eps), cos, sin)
        k = rotate_tail(self.kv_norm(kv).unsqueeze(1), cos, sin).squeeze(1)

        keys = torch.cat((state.window, k))  # positions start - w .. start + n - 1
        if n == 1 and sparse_native.usable(x, keys):
            return self._decode_native(x, (q_res, q, keys), start, state, rope, (cos, sin))
        new = V4AttentionState(keys[max(0, keys.shape[0] - (self.window - 1)) :].clone())
        entries: torch.Tensor | None = None
        chosen: torch.Tensor | None = None
        if self.compressor is not None:
            assert state.compressor is not None
            new.compressor = self.compressor(x, state.compressor, rope)
            entries = new.compressor.entries
            if self.indexer is not None:
                assert state.indexer is not None
                chosen, new.indexer = self.indexer(x, q_res, qpos, state.indexer, rope, cos, sin)
        w = state.window.shape[0]
        if chosen is not None and not self.masked_prefill:
            assert entries is not None
            out = self._attend_selected(q, keys, w, entries, chosen)
        else:
            out = self._attend_masked(q, keys, start, w, entries, chosen)
        return self._output(out, cos, sin), new

    def _attend_masked(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        start: int,
        w: int,
        entries: torch.Tensor | None,
        chosen: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of the queries q [N, heads, D] at positions start .. start + N - 1 over
        ``keys`` [w + N, D] (positions start - w ..; the window's masked in) and, HCA / CSA,
        over every entry [E, D], masked to those visible (HCA) or to the ``chosen`` [N, k]
        (CSA, -1 padded) -> [N, heads, D]. The reference: every query scored against every
        entry (CSA prefill uses `_attend_selected` unless ``masked_prefill``)."""
        n, dev = q.shape[0], q.device
        qpos = start + torch.arange(n, device=dev)
        kpos = start - w + torch.arange(keys.shape[0], device=dev)
        near = (kpos.unsqueeze(0) <= qpos.unsqueeze(1)) & (
            kpos.unsqueeze(0) > qpos.unsqueeze(1) - self.window
        )
        logits = [torch.einsum("nhd,cd->hnc", q, keys).masked_fill(~near, float("-inf"))]
        values = [keys]
        if entries is not None:
            ent = torch.arange(entries.shape[0], device=dev)
            seen = ent.unsqueeze(0) < visible_entries(qpos, self.rate).unsqueeze(1)  # [N, E]
            if chosen is not None:
                picked = torch.zeros(n, entries.shape[0] + 1, dtype=torch.bool, device=dev)
                e = entries.shape[0]
                picked.scatter_(1, torch.where(chosen < 0, e, chosen), True)
                seen = seen & picked[:, :e]
            logits.append(torch.einsum("nhd,ed->hne", q, entries).masked_fill(~seen, float("-inf")))
            values.append(entries)
        sink = self.sinks.float().view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat([lg * self.scale for lg in logits] + [sink], -1), -1)
        return torch.matmul(probs[..., :-1], torch.cat(values)).transpose(0, 1)  # [N, heads, D]

    def _attend_selected(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        w: int,
        entries: torch.Tensor,
        chosen: torch.Tensor,
    ) -> torch.Tensor:
        """`_attend_masked` of a CSA layer reading only the rows each query attends to: per
        block of queries, the window's keys the block spans (masked to each query's window)
        and each query's ``chosen`` entries gathered ([block, k, D]). The block holds at most
        ``SELECTED_BLOCK`` gathered elements (the copy, the logits and the mask bounded at any
        context length). -> [N, heads, D]."""
        n, heads, d = q.shape
        k, dev = max(1, chosen.shape[1]), q.device
        block = max(1, min(n, self.selected_block // (k * max(d, heads))))
        sink = self.sinks.float().view(1, -1, 1)
        out = torch.empty(n, heads, d, device=dev)
        for i0 in range(0, n, block):
            i1 = min(n, i0 + block)
            # keys of query i (index w + i in keys): w + i - window + 1 .. w + i
            lo, hi = max(0, i0 + w - self.window + 1), i1 + w
            kb, qb = keys[lo:hi], q[i0:i1]
            j = lo + torch.arange(hi - lo, device=dev)
            qi = w + torch.arange(i0, i1, device=dev).unsqueeze(1)
            near = (j.unsqueeze(0) <= qi) & (j.unsqueeze(0) > qi - self.window)  # [b, c]
            lw = torch.einsum("bhd,cd->bhc", qb, kb).masked_fill(~near.unsqueeze(1), -torch.inf)
            cb = chosen[i0:i1]
            picked = entries[cb.clamp(min=0)]  # [b, k, D]
            le = torch.bmm(qb, picked.transpose(1, 2))  # [b, heads, k]
            le = le.masked_fill((cb < 0).unsqueeze(1), -torch.inf)
            probs = torch.softmax(
                torch.cat((lw * self.scale, le * self.scale, sink.expand(i1 - i0, -1, 1)), -1), -1
            )
            c = kb.shape[0]
            out[i0:i1] = torch.matmul(probs[..., :c], kb) + torch.bmm(probs[..., c:-1], picked)
        return out

    def _output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [N, heads, D] -> [N, hidden]: the values' rope undone, then the
        grouped low-rank projection."""
        out = rotate_tail(out, cos, -sin)
        return self.o_b_proj(self.o_a_proj(out.reshape(out.shape[0], self.groups, -1)))

    def _decode_native(
        self,
        x: torch.Tensor,
        projected: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        start: int,
        state: V4AttentionState,
        rope: Rope,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, V4AttentionState]:
        """`forward` of one token (x [1, hidden]; its compressed query, query and the window's
        keys with its own ``projected``) with the native kernels: the window's keys (all
        visible) and the entries it sees, chosen by the indexer (CSA), in one call."""
        sn = sparse_native
        (q_res, q, keys), (cos, sin) = projected, cos_sin
        new = V4AttentionState(keys[max(0, keys.shape[0] - (self.window - 1)) :].clone())
        segs = [sn.Segment(sn.Rows(keys.contiguous()), None, 0, keys.shape[0])]
        if self.compressor is not None:
            assert state.compressor is not None
            new.compressor = self.compressor(x, state.compressor, rope)
            entries = new.compressor.entries.contiguous()
            seen = (start + 1) // self.rate
            assert entries.shape[0] >= seen
            rows = sn.Rows(entries)
            ix = self.indexer
            if ix is not None:
                assert state.indexer is not None
                new.indexer = ix.compressor(x, state.indexer, rope)
                if seen > ix.topk:
                    iq = rotate_tail(ix.q_b_proj(q_res).view(1, ix.heads, ix.dim), cos, sin)[0]
                    iw = ix.weights_proj(x)[0] * ix.heads**-0.5
                    ik = sn.Rows(new.indexer.entries.contiguous())
                    sel, _ = sn.index_topk(iq, iw, ik, seen, ix.topk, ix.dim**-0.5)
                    segs.append(sn.Segment(rows, sel))
                    seen = 0
            if seen:
                segs.append(sn.Segment(rows, None, 0, seen))
        out = sn.sparse_attention(q[0], segs, self.head_dim, self.scale, self.sinks)
        return self._output(out.unsqueeze(0), cos, sin), new
