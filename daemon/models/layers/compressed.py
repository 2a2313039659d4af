"""KV compression and the Lightning Indexer (DeepSeek-V4's CSA / HCA; the indexer also serves
DeepSeek-V3.2-style sparse attention).

A compressor turns every window of ``rate`` tokens into one compressed KV entry:

    kv, gate = x W_kv, x W_gate                      per token, [width] each
    entry_w  = kv_norm( sum_slots softmax_slots(gate + position_bias) * kv )
    entry_w  = rope(entry_w) on its trailing rope slice, at position w * rate

* non-overlapping (HCA): width = dim; window w's slots are its own ``rate`` tokens.
* overlapping (CSA): width = 2 * dim, two series per token, Ca = [:dim] and Cb = [dim:]. Window
  w's 2 * rate slots are the Ca halves of window w - 1's tokens then the Cb halves of its own
  (width 2 * rate, stride rate). Window 0 has no predecessor: its Ca slots weigh 0.

Entry w exists once window w has closed, i.e. for queries at positions >= (w + 1) * rate - 1:
a query at position p sees entries [0, (p + 1) // rate).

`CompressorState` is what one sequence carries between forwards: the entries so far, the open
window's projected kv / gate rows (fewer than ``rate``) and, overlapping only, the last closed
window's Ca kv / gate (with the position bias added). A forward over any number of new tokens
from a state equals the forward over all tokens at once. The engine keeps the entries in the
paged KV pool instead (``stored`` of them: `CompressorState.detached`), the state then the
open window and the overlap alone, a size that does not grow with the sequence.

The Lightning Indexer has its own (overlapping) compressor at ``index_head_dim`` and scores each
query against the visible entries:

    score(t, s) = sum_h w(t, h) * relu(q(t, h) . k_s) / sqrt(index_head_dim)
    w(t, h)     = (x W_w)(t, h) / sqrt(index_heads),   q(t) = rope(q_res(t) W_qb)

then keeps the ``topk`` best visible entries per query (`select_topk`).

RoPE here is DeepSeek-V4's: on the TRAILING ``rope_dim`` channels of a head, pairs interleaved
(channels (2i, 2i + 1) of the slice rotate by angle i), the layout kept (`rotate_tail`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .common import Linear, RMSNorm, param, project
from .rope import Rope


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos, sin [N, r / 2] -> x with its last r channels rotated as interleaved
    pairs, in place of the pair (the output keeps x's channel order). ``-sin`` undoes it. fp32."""
    r = 2 * cos.shape[-1]
    x = x.float()
    if r == 0:
        return x
    tail = x[..., -r:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], rot), dim=-1)


def visible_entries(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """[N] positions -> [N] number of compressed entries each query sees: (p + 1) // rate."""
    return torch.div(positions + 1, rate, rounding_mode="floor")


@dataclass
class CompressorState:
    """One sequence's compressor state (see the module docstring)."""

    rate: int
    entries: torch.Tensor  # [E, dim] fp32, rope applied; entry w covers tokens [w*rate, (w+1)*rate)
    kv: torch.Tensor  # [r, width] the open window's projected kv, r < rate
    gate: torch.Tensor  # [r, width] and its gate logits (without the position bias)
    prev_kv: torch.Tensor | None = None  # overlapping: [rate, dim] Ca of the last closed window
    prev_gate: torch.Tensor | None = None  # [rate, dim] its gate logits + position bias
    stored: int = 0  # entries before ``entries``, kept elsewhere (the engine's paged pool)

    @property
    def num_entries(self) -> int:
        """Entries so far: those kept elsewhere and those held here."""
        return self.stored + int(self.entries.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens compressed or pending: E * rate + r (the next token's position)."""
        return self.num_entries * self.rate + int(self.kv.shape[0])

    def detached(self) -> CompressorState:
        """This state without its entries (``stored`` counts them): what is left once they are
        kept elsewhere."""
        empty = self.entries.new_zeros(0, self.entries.shape[1])  # not a view: frees them
        return replace(self, entries=empty, stored=self.num_entries)

    def attached(self, entries: torch.Tensor) -> CompressorState:
        """This state with all its entries held (``entries`` [num_entries, dim], read back from
        where they are kept)."""
        if entries.shape[0] != self.num_entries or self.entries.shape[0]:
            raise ValueError(
                f"{entries.shape[0]} entries given for a state of {self.num_entries} "
                f"({self.entries.shape[0]} held)"
            )
        return replace(self, entries=entries, stored=0)

    @property
    def nbytes(self) -> int:
        ts = (self.entries, self.kv, self.gate, self.prev_kv, self.prev_gate)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def clone(self) -> CompressorState:
        def cl(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone()

        return replace(
            self,
            entries=self.entries.clone(),
            kv=self.kv.clone(),
            gate=self.gate.clone(),
            prev_kv=cl(self.prev_kv),
            prev_gate=cl(self.prev_gate),
        )


class Compressor(nn.Module):
    def __init__(
        self, hidden: int, dim: int, rate: int, overlap: bool, eps: float, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.width = 2 * dim if overlap else dim
        self.kv_proj = Linear(hidden, self.width, dtype)
        self.gate_proj = Linear(hidden, self.width, dtype)
        self.position_bias = param(rate, self.width, dtype=torch.float32)
        self.kv_norm = RMSNorm(dim, eps, torch.float32)

    def empty_state(self, device: torch.device | None = None) -> CompressorState:
        z = torch.zeros(0, self.width, device=device)
        return CompressorState(self.rate, torch.zeros(0, self.dim, device=device), z, z.clone())

    def state_bytes(self, tokens: int, entries: bool = True) -> int:
        """Bytes of a `CompressorState` after ``tokens`` tokens (fp32, `CompressorState.nbytes`):
        one entry per closed window (unless ``entries`` is False: a detached state), the open
        window's kv and gate rows, and (overlapping) the last closed window's Ca kv and gate."""
        closed, rows = divmod(tokens, self.rate)
        prev = 2 * self.rate * self.dim if self.overlap and closed else 0
        return 4 * (closed * self.dim * entries + 2 * rows * self.width + prev)

    def max_open_bytes(self) -> int:
        """The most `state_bytes` holds beside its entries (rate - 1 open rows, the overlap)."""
        prev = 2 * self.rate * self.dim if self.overlap else 0
        return 4 * (2 * (self.rate - 1) * self.width + prev)

    def forward(self, x: torch.Tensor, state: CompressorState, rope: Rope) -> CompressorState:
        """Appends x [N, hidden] (the next N tokens of the sequence) -> the new state; its
        ``entries`` end with the windows these tokens closed."""
        kv, gate = project(x, (self.kv_proj, self.gate_proj))
        kv = torch.cat((state.kv, kv.float()))
        gate = torch.cat((state.gate, gate.float()))
        first = state.num_entries * self.rate  # position of the first row of kv
        m = kv.shape[0] // self.rate
        used = m * self.rate
        if m == 0:
            return replace(state, kv=kv, gate=gate)
        # the open rows copied out: a view would keep the whole chunk's rows alive
        new = replace(state, kv=kv[used:].clone(), gate=gate[used:].clone())
        w_kv = kv[:used].view(m, self.rate, self.width)
        w_gate = gate[:used].view(m, self.rate, self.width) + self.position_bias.float()
        if self.overlap:
            d = self.dim
            if state.prev_kv is None or state.prev_gate is None:  # window 0: nothing before it
                head_kv = w_kv.new_zeros(1, self.rate, d)
                head_gate = w_gate.new_full((1, self.rate, d), float("-inf"))
            else:
                head_kv, head_gate = state.prev_kv.unsqueeze(0), state.prev_gate.unsqueeze(0)
            slot_kv = torch.cat(
                (torch.cat((head_kv, w_kv[:-1, :, :d])), w_kv[:, :, d:]), dim=1
            )  # [m, 2 * rate, d]
            slot_gate = torch.cat((torch.cat((head_gate, w_gate[:-1, :, :d])), w_gate[:, :, d:]), 1)
            new.prev_kv, new.prev_gate = w_kv[-1, :, :d].clone(), w_gate[-1, :, :d].clone()
        else:
            slot_kv, slot_gate = w_kv, w_gate
        pooled = (slot_kv * torch.softmax(slot_gate, dim=1)).sum(1)
        entries = self.kv_norm(pooled)
        pos = first + self.rate * torch.arange(m, device=x.device)
        cos, sin = rope.cos_sin(pos, first + self.rate * (m - 1))  # the max, known here
        entries = rotate_tail(entries.unsqueeze(1), cos, sin).squeeze(1)
        new.entries = torch.cat((state.entries, entries))
        return new


# bytes of the [queries, heads, entries] fp32 dot products `Indexer` scores at a time (at 16k
# tokens, 4096 entries of V4-Flash's 64 indexer heads: blocks of 64 queries)
INDEX_SCORE_BYTES = 64 << 20


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The Lightning Indexer's scores: q [N, heads, D] (fp32), keys [E, D], weights [N, heads]
    (x W_w) -> [N, E] fp32, sum_h weights(t, h) / sqrt(heads) * relu(q(t, h) . k_s) / sqrt(D).
    Shared by DeepSeek-V4's compressed entries and DeepSeek-V3.2 / GLM-5's per-token keys."""
    heads, dim = q.shape[1], q.shape[2]
    dots = F.relu(torch.einsum("nhd,ed->nhe", q, keys.float())) * dim**-0.5
    w = weights.float() * heads**-0.5
    return (dots * w.unsqueeze(-1)).sum(1)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [N, E] (-inf: not selectable) -> [N, min(k, E)] entry indices, best first; -1
    where fewer than k entries are selectable.

    Ties are broken towards the LOWER entry index (the earlier window): a stable descending sort
    keeps equal scores in index order. transformers' ``torch.topk`` leaves ties undefined (its
    choice changes with the tensor's shape, so its full forward and its cached decode can pick
    different entries when scores tie; exact ties are common with few indexer heads, where the
    ReLU zeroes every head's term)."""
    k = min(k, scores.shape[-1])
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    idx, vals = idx[:, :k], vals[:, :k]
    return torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx)


class Indexer(nn.Module):
    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        heads: int,
        dim: int,
        rate: int,
        topk: int,
        eps: float,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.heads, self.dim, self.rate, self.topk = heads, dim, rate, topk
        self.compressor = Compressor(hidden, dim, rate, True, eps, dtype)
        self.q_b_proj = Linear(q_lora_rank, heads * dim, dtype)
        self.weights_proj = Linear(hidden, heads, dtype)

    def scores(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        positions: torch.Tensor,
        entries: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """[N, E] index scores of each query against the entries; -inf where not visible."""
        n = x.shape[0]
        q = rotate_tail(self.q_b_proj(q_res).view(n, self.heads, self.dim), cos, sin)
        s = index_scores(q, entries, self.weights_proj(x))
        ent = torch.arange(entries.shape[0], device=x.device)
        hidden = ent.unsqueeze(0) >= visible_entries(positions, self.rate).unsqueeze(1)
        return s.masked_fill(hidden, float("-inf"))

    def forward(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        positions: torch.Tensor,
        state: CompressorState,
        rope: Rope,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, CompressorState]:
        """-> (selected entries [N, <= topk] with -1 padding, the indexer's new state).
        cos, sin: the compress rope at the queries' positions."""
        state = self.compressor(x, state, rope)
        n, e = x.shape[0], state.entries.shape[0]
        # blocks of queries: their [block, heads, E] dot products within INDEX_SCORE_BYTES
        step = max(1, INDEX_SCORE_BYTES // (4 * self.heads * max(1, e)))
        out = []
        for b0 in range(0, n, step):
            b = slice(b0, min(n, b0 + step))
            s = self.scores(x[b], q_res[b], positions[b], state.entries, cos[b], sin[b])
            out.append(select_topk(s, self.topk))
        return (out[0] if len(out) == 1 else torch.cat(out)), state
