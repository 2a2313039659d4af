"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): its own top level (family: families/deepseek_v4.py).

What differs from `model.CausalLM`: the residual is ``hc_mult`` streams mixed by hyper-connections
(layers/hyper.py); attention has one shared K = V head, a sliding window and, per layer type,
compressed entries (HCA: all, CSA: the Lightning Indexer's top-k; layers/compressed.py,
layers/v4_attention.py); the MoE routes by sqrt(softplus) scores or, in the first layers, by a
token-id hash, with a clamped SwiGLU (layers/v4_routing.py).

`DeepseekV4LM` runs one sequence with its routed experts as plain parameters
(`RoutedExperts`, the expert-bank layout); `DeepseekV4CausalLM` is the engine's: the same
modules, the routed experts in ExpertBanks behind the MoE backend (``Activation.SWIGLU_CLAMP``),
a ForwardBatch of several sequences, each chunk's attention on its ``SeqState.v4`` and the
compressed entries in its pages of the KV pool (below: what is where).

Incremental state and how it maps onto the engine's memory
----------------------------------------------------------
`forward(ids, state)` runs any number of next tokens of one sequence from its `V4SeqState` and
returns the new state; the full forward is the same call from `new_state()`, and prefill then
decode, or a prefill cut anywhere (inside open windows too), gives the same result. Per layer
(`v4_attention.V4AttentionState`):

* ``window``: the last window - 1 keys, [head_dim] per token (K = V); attention reads the
  rows of (p - window, p]. In the engine too they stay in the sequence's state (a bounded
  size: a snapshot copies them).
* ``compressor.entries`` (CSA and HCA) and ``indexer.entries`` (CSA): ONE entry per ``rate``
  tokens ([head_dim], resp. [index_head_dim]), written when a window closes (the token at
  position (w + 1) * rate - 1 writes entry w). In the engine they live in the paged KV pool:
  one page region per compressor (kv/pool.py), ``ceil(page_size / rate)`` rows a page. Entry w
  is a row of the page holding its closing token, position c = (w + 1) * rate - 1: page
  c // page_size, row w - (page * page_size) // rate (`entry_slots`). It depends on the tokens
  up to c alone, so the page holds it as it holds its tokens' KV: the radix tree shares it by
  prefix, a resume retains the prefix's pages (copying a partial page on write), and a
  released page frees it.
* ``compressor.kv / gate`` (the open window: fewer than ``rate`` tokens' projected kv and gate
  logits, width 2 * head_dim for CSA) and, CSA only, ``prev_kv / prev_gate`` (the last closed
  window's Ca half, [rate, head_dim] each), likewise for the indexer: fixed-size per sequence
  and layer, not per token, like the DeltaNet ``RecurrentState`` (kv/seq_state.py).

The engine's ``SeqState.v4`` is the `V4SeqState` without the entries (each compressor state
``detached``: its ``stored`` entries are in the sequence's pages): the window's keys, the open
windows and the overlaps, at most ``state_bytes_per_seq`` bytes whatever the length. A forward
reads a chunk's entries from its pages (the compressors' states ``attached``), runs the layer
and writes the entries it closed back. The prefix cache snapshots that state at anchors, as it
snapshots the DeltaNet state: a snapshot's size does not grow with its position
(``state_bytes``), and a prefix hit resumes at a snapshot on its path (inside an open window
too) with the prefix's pages, entries included, from the radix tree. V4 snapshots are not
spilled to disk (kv/spill.py writes only DeltaNet states). The window's keys stay in the
snapshot (window - 1 rows a layer), not in the pool.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..kv.pool import KVPool
from .batch import ForwardBatch, SeqChunk
from .config import ModelConfig
from .families.deepseek_v4 import CSA, HCA, LAYER_NAMES, SLIDING, TOP_NAMES, V4Config, v4_config
from .layers.common import Embedding, Linear, RMSNorm, dtype_of, param
from .layers.compressed import Compressor
from .layers.hyper import HyperConnection, HyperHead, expand_streams, merge_streams
from .layers.rope import Rope
from .layers.v4_attention import IndexerShape, V4Attention, V4AttentionState
from .layers.v4_routing import ClampedMLP, V4Router, clamped_swiglu
from .model import PAGE_SIZE, CausalLM


class RoutedExperts(nn.Module):
    """One layer's routed experts in the expert-bank layout (experts/banks.py): ``gate_up``
    [E, 2I, H] (gate rows first), ``down`` [E, H, I]; clamped SwiGLU. A plain-torch stand-in
    for the MoE backend."""

    def __init__(self, e: int, hidden: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit, self.inter = limit, inter
        self.gate_up = param(e, 2 * inter, hidden, dtype=dtype)
        self.down = param(e, hidden, inter, dtype=dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids / w [T, K] -> sum_k w[t, k] * expert_{ids[t, k]}(x[t]), fp32."""
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            gu = torch.nn.functional.linear(x[tok].to(self.gate_up.dtype), self.gate_up[e]).float()
            h = clamped_swiglu(gu[:, : self.inter], gu[:, self.inter :], self.limit)
            y = torch.nn.functional.linear(h.to(self.down.dtype), self.down[e]).float()
            out.index_add_(0, tok, y * w[tok, slot].unsqueeze(1))
        return out


# (ids [T, K], weights [T, K] fp32) -> the routed experts' weighted sum [T, hidden] fp32
Routed = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class V4MoE(nn.Module):
    """Router, routed experts and the clamped shared expert. ``banked``: the routed experts are
    not parameters here but live in the engine's ExpertBanks behind its MoE backend (the
    ``Activation.SWIGLU_CLAMP`` kind); `forward` then gets them as ``routed``."""

    def __init__(self, cfg: V4Config, i: int, dtype: torch.dtype, banked: bool = False) -> None:
        super().__init__()
        hid, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.router = V4Router(
            hid,
            cfg.num_experts,
            cfg.top_k,
            cfg.routed_scaling_factor,
            dtype,
            hash_vocab=cfg.vocab_size if cfg.hash_layers[i] else 0,
        )
        self.experts: RoutedExperts | None = None
        if not banked:
            self.experts = RoutedExperts(cfg.num_experts, hid, inter, cfg.swiglu_limit, dtype)
        # one shared expert of the routed width (transformers ignores n_shared_experts)
        self.shared_expert = ClampedMLP(hid, inter, cfg.swiglu_limit, dtype)

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor, routed: Routed | None = None
    ) -> torch.Tensor:
        """x [T, hidden] (normed), token_ids [T] (the hash layers' keys) -> [T, hidden] fp32."""
        ids, w = self.router(x, token_ids)
        if routed is None:
            assert self.experts is not None, "banked experts: pass routed"
            out = self.experts(x, ids, w)
        else:
            out = routed(ids, w)
        return out + self.shared_expert(x)


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, i: int, dtype: torch.dtype, banked: bool = False) -> None:
        super().__init__()
        hid, eps, n = cfg.hidden_size, cfg.rms_norm_eps, cfg.hc_mult
        self.kind = cfg.layer_types[i]
        self.attn_hc = HyperConnection(n, hid, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.ffn_hc = HyperConnection(n, hid, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.input_layernorm = RMSNorm(hid, eps, torch.float32)
        self.post_attention_layernorm = RMSNorm(hid, eps, torch.float32)
        index = IndexerShape(cfg.index_heads, cfg.index_head_dim, cfg.index_topk)
        self.self_attn = V4Attention(
            hidden=hid,
            heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            q_lora_rank=cfg.q_lora_rank,
            o_groups=cfg.o_groups,
            o_lora_rank=cfg.o_lora_rank,
            window=cfg.sliding_window,
            eps=eps,
            dtype=dtype,
            compress_rate=cfg.compress_rates[i],
            indexer=index if self.kind == CSA else None,
        )
        self.mlp = V4MoE(cfg, i, dtype, banked)

    def forward(
        self,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        start: int,
        state: V4AttentionState,
        rope: Rope,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, V4AttentionState]:
        """streams [N, hc, hidden] -> (new streams, the layer's new state)."""
        x, post, comb = self.attn_hc(streams)
        a, state = self.self_attn(self.input_layernorm(x), start, state, rope, cos, sin)
        streams = merge_streams(streams, a, post, comb)
        x, post, comb = self.ffn_hc(streams)
        m = self.mlp(self.post_attention_layernorm(x), token_ids)
        return merge_streams(streams, m, post, comb), state


@dataclass
class V4SeqState:
    layers: list[V4AttentionState]
    num_tokens: int = 0

    def clone(self) -> V4SeqState:
        return V4SeqState([s.clone() for s in self.layers], self.num_tokens)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)


class _V4Body(nn.Module):
    """The modules of a V4 model, shared by the one-sequence `DeepseekV4LM` and the engine's
    `DeepseekV4CausalLM` (each its own forward). ``banked``: the routed experts are left to an
    MoE backend (not parameters here)."""

    def _build(self, cfg: V4Config, banked: bool) -> None:
        self.v4 = cfg
        dtype = dtype_of(cfg.torch_dtype)
        hid = cfg.hidden_size
        self.embed_tokens = Embedding(cfg.vocab_size, hid, dtype)
        self.layers = nn.ModuleList(
            V4DecoderLayer(cfg, i, dtype, banked) for i in range(cfg.num_layers)
        )
        self._layers: list[V4DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        self.hc_head = HyperHead(cfg.hc_mult, hid, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm = RMSNorm(hid, cfg.rms_norm_eps, torch.float32)
        self.lm_head = Linear(hid, cfg.vocab_size, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope_main = Rope(cfg.rope_main)
        self.rope_compress = Rope(cfg.rope_compress)

    def new_state(self, device: torch.device | None = None) -> V4SeqState:
        return V4SeqState([la.self_attn.empty_state(device) for la in self._layers])

    def state_bytes(self, tokens: int) -> int:
        """Bytes of the `V4SeqState` of a sequence of ``tokens`` tokens (its ``nbytes``)."""
        return sum(la.self_attn.state_bytes(tokens) for la in self._layers)

    def _ropes(
        self, pos: torch.Tensor, max_position: int | None = None
    ) -> dict[str, tuple[Rope, torch.Tensor, torch.Tensor]]:
        """Per layer type: (its rope, cos, sin at ``pos``)."""
        out = {}
        for kind, rope in ((SLIDING, self.rope_main), (CSA, self.rope_compress)):
            out[kind] = (rope, *rope.cos_sin(pos, max_position))
        out[HCA] = out[CSA]
        return out


class DeepseekV4LM(_V4Body):
    """One sequence at a time: `forward(ids, state) -> (logits, new state)`, the routed experts
    plain parameters (`RoutedExperts`)."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.cfg = cfg
        self._build(cfg, banked=False)

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, state: V4SeqState
    ) -> tuple[torch.Tensor, V4SeqState]:
        """token_ids [N]: the sequence's next N tokens -> (logits [N, vocab] fp32, new state)."""
        start, n = state.num_tokens, token_ids.shape[0]
        ropes = self._ropes(start + torch.arange(n, device=token_ids.device))
        w = self.embed_tokens.weight
        streams = expand_streams(w.index_select(0, token_ids).float(), self.v4.hc_mult)
        layer_states = []
        for layer, st in zip(self._layers, state.layers, strict=True):
            rope, cos, sin = ropes[layer.kind]
            streams, st = layer(streams, token_ids, start, st, rope, cos, sin)
            layer_states.append(st)
        h = self.norm(self.hc_head(streams))
        return self.lm_head(h), V4SeqState(layer_states, start + n)


class DeepseekV4CausalLM(CausalLM, _V4Body):
    """DeepSeek-V4 to the engine (``FamilySpec.model``): a CausalLM's attributes for the runner,
    the planner and the placement, its own forward over a `ForwardBatch`.

    Layer by layer, the hyper-connections, norms and MoE run over all N rows of the batch (the
    routed experts through ``batch.moe``: ExpertBanks with the clamped SwiGLU, hash layers keyed
    by ``batch.token_ids``); attention runs per `SeqChunk` on that sequence's `V4SeqState`
    (``SeqState.v4``, made by the runner), which the forward replaces by the new one.

    The compressed entries live in the pool's page regions (``pool_regions``, the module
    docstring); the rest of the state per sequence, ``SeqState.v4`` (the model has no pool
    layer: ``num_attention_layers`` 0), which the prefix cache snapshots and restores
    (``own_state``: engine/prefix.py).

    Accounting: the page regions' bytes per token are ``state_bytes_per_token``, counted by
    ``kv_bytes_per_token`` with the pool's tokens (the planner's KV share, the slot budget's KV
    reserve); what a sequence holds whatever its length (the windows' keys, the open compressor
    windows, the CSA overlaps) is ``state_bytes_per_seq``, reserved per sequence in flight
    (engine/placement.device_state_bytes), and ``state_bytes(n)`` is a snapshot's size. The
    pool's pages (one 1 x 1 K / V layer beside the regions) are the token ledger admission and
    preemption run on: a V4 sequence holds a page per ``page_size`` tokens as any other."""

    own_state = True  # SeqState.v4

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)  # not CausalLM's modules
        self.cfg = cfg
        self.dtype = dtype_of(cfg.torch_dtype)
        self._build(replace(v4_config(cfg.raw), torch_dtype=cfg.torch_dtype), banked=True)
        self.rope = self.rope_main
        self.num_attention_layers = 0
        self.num_linear_layers = 0
        self.kv_geometry = (1, 1)  # the pool's minimum (one layer of it is allocated)
        self.kv_layer_shapes = None
        self._decoder_layers = []  # no layer of the shared skeleton (no native decode plan)
        self._decode_head = None

    def new_v4_state(self, device: torch.device | None = None) -> V4SeqState:
        return self.new_state(device)

    def _compressor_slots(self) -> list[tuple[int, int, Compressor]]:
        """(layer, 0 its own / 1 its indexer's, the compressor) in page-region order."""
        return [
            (i, j, c)
            for i, la in enumerate(self._layers)
            for j, c in enumerate(la.self_attn.compressors())
        ]

    def pool_regions(self, page_size: int) -> list[tuple[int, int]]:
        """(rows, width) of a page region per compressor (`_compressor_slots`' order): the
        entries whose window closes in the page, at most ``ceil(page_size / rate)``."""
        return [(-(-page_size // c.rate), c.dim) for _, _, c in self._compressor_slots()]

    def state_bytes_per_token(self, page_size: int = PAGE_SIZE) -> int:
        """The page regions' bytes per token, rounded up: the compressed entries (and the
        indexer's), one per ``rate`` tokens per layer, in rows of ``page_size``-token pages."""
        page = sum(4 * rows * width for rows, width in self.pool_regions(page_size))
        return -(-page // page_size)

    def state_bytes(self, tokens: int) -> int:
        """Bytes of a sequence's ``SeqState.v4`` after ``tokens`` tokens (its ``nbytes``, a
        snapshot's size): the windows' keys and the compressors' states, not their entries."""
        return sum(la.self_attn.state_bytes(tokens, entries=False) for la in self._layers)

    def state_bytes_per_seq(self) -> int:
        """The most a sequence's state holds beside its entries: every layer's full window of
        keys, its compressors' open windows and CSA overlaps."""
        return sum(la.self_attn.max_fixed_bytes() for la in self._layers)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # type: ignore[override]
        """-> logits [len(batch.logits_rows), vocab] fp32; each chunk's ``state.v4`` advanced
        by its rows."""
        ids, chunks = batch.token_ids, batch.chunks
        states: list[V4SeqState] = []
        row = 0
        for ch in chunks:
            st = ch.state.v4
            if not isinstance(st, V4SeqState):
                raise ValueError("a DeepSeek-V4 sequence without its state (SeqState.v4)")
            if st.num_tokens != ch.context_len or ch.start != row:
                raise ValueError(
                    f"DeepSeek-V4 state holds {st.num_tokens} tokens, the chunk starts at "
                    f"{ch.context_len} (row {ch.start}, expected {row})"
                )
            states.append(st)
            row += ch.length
        if row != ids.shape[0]:
            raise ValueError(f"chunks cover {row} rows of {ids.shape[0]}")
        ropes = self._ropes(batch.positions, batch.max_position)
        w = self.embed_tokens.weight
        streams = expand_streams(w.index_select(0, ids).float(), self.v4.hc_mult)
        new: list[list[V4AttentionState]] = [[] for _ in chunks]
        regions = self._regions(batch.kv)
        moe_index = self.cfg.moe_layer_index
        for i, layer in enumerate(self._layers):  # hash layers: their experts are known now
            table = layer.mlp.router.tid2eid
            if table is not None:
                batch.moe.known_routes(moe_index[i], table.index_select(0, ids.to(table.device)))
        for i, layer in enumerate(self._layers):
            rope, cos, sin = ropes[layer.kind]
            x, post, comb = layer.attn_hc(streams)
            x = layer.input_layernorm(x)
            parts = []
            for c, (ch, st) in enumerate(zip(chunks, states, strict=True)):
                r = slice(ch.start, ch.start + ch.length)
                ls = self._attached(st.layers[i], regions[i], ch)
                out, ls = layer.self_attn(x[r], ch.context_len, ls, rope, cos[r], sin[r])
                parts.append(out)
                new[c].append(self._detached(ls, st.layers[i], regions[i], ch))
            streams = merge_streams(streams, torch.cat(parts), post, comb)
            x, post, comb = layer.ffn_hc(streams)
            x = layer.post_attention_layernorm(x)

            def routed(e: torch.Tensor, wt: torch.Tensor, i: int = i, x: torch.Tensor = x) -> Any:
                return batch.moe.forward(moe_index[i], x, e, wt)

            streams = merge_streams(streams, layer.mlp(x, ids, routed), post, comb)
        for ch, layers in zip(chunks, new, strict=True):
            ch.state.v4 = V4SeqState(layers, ch.context_len + ch.length)
        h = self.norm(self.hc_head(streams[batch.logits_rows]))
        return self.lm_head(h)

    def _regions(self, kv: KVPool) -> list[list[_Region]]:
        """Per layer, its compressors' page regions in ``kv`` (`pool_regions`)."""
        slots = self._compressor_slots()
        if len(kv.regions) != len(slots):
            raise ValueError(
                f"a KV pool with {len(kv.regions)} page regions for DeepSeek-V4's {len(slots)} "
                "compressors (ModelRunner makes it with `pool_regions`)"
            )
        out: list[list[_Region]] = [[] for _ in self._layers]
        for (i, _, c), t in zip(slots, kv.regions, strict=True):
            out[i].append(_Region(t, c.rate, kv.page_size))
        return out

    @staticmethod
    def _attached(st: V4AttentionState, regions: list[_Region], ch: SeqChunk) -> V4AttentionState:
        """The layer's state with its entries read from the chunk's pages."""
        if not regions:
            return st
        states = [st.compressor, st.indexer][: len(regions)]
        assert ch.table is not None and all(s is not None for s in states)
        full = [
            s.attached(reg.read(ch.table, s.num_entries))
            for s, reg in zip(states, regions, strict=True)
            if s is not None
        ]
        return V4AttentionState(st.window, *full)

    @staticmethod
    def _detached(
        new: V4AttentionState, old: V4AttentionState, regions: list[_Region], ch: SeqChunk
    ) -> V4AttentionState:
        """The layer's new state without its entries, those it closed written to the chunk's
        pages (``old``: the state before, detached)."""
        pairs = [(new.compressor, old.compressor), (new.indexer, old.indexer)][: len(regions)]
        assert ch.table is not None
        for (s, before), reg in zip(pairs, regions, strict=True):
            assert s is not None and before is not None
            done = before.num_entries
            if s.num_entries > done:
                reg.write(ch.table, done, s.entries[done:])
        return new.detached()


@dataclass(frozen=True)
class _Region:
    """A compressor's page region of the KV pool: [pages, rows, width], entry w in the page of
    its closing token (`entry_slots`)."""

    rows: torch.Tensor
    rate: int
    page_size: int

    def _flat(self, table: torch.Tensor, first: int, last: int) -> torch.Tensor:
        pages, rows = entry_slots(first, last, self.rate, self.page_size, table.device)
        return table[pages].long() * self.rows.shape[1] + rows

    def read(self, table: torch.Tensor, n: int) -> torch.Tensor:
        """Entries [0, n) of the sequence with page table ``table`` -> [n, width]."""
        flat = self.rows.view(-1, self.rows.shape[-1])
        return flat.index_select(0, self._flat(table, 0, n))

    def write(self, table: torch.Tensor, first: int, entries: torch.Tensor) -> None:
        """Stores ``entries`` [m, width] as entries [first, first + m) of the sequence."""
        flat = self.rows.view(-1, self.rows.shape[-1])
        idx = self._flat(table, first, first + entries.shape[0])
        flat.index_copy_(0, idx, entries.to(flat.dtype))


def entry_slots(
    first: int, last: int, rate: int, page_size: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where entries [first, last) of a compressor at ``rate`` live in a sequence's pages:
    (page index in its table, row in that page's region), each [last - first]. Entry w is in
    the page of its closing token c = (w + 1) * rate - 1, at row w - (page * page_size) // rate
    (the page's first entry is the first to close in it), below ``ceil(page_size / rate)``."""
    w = torch.arange(first, last, device=device)
    page = torch.div((w + 1) * rate - 1, page_size, rounding_mode="floor")
    return page, w - torch.div(page * page_size, rate, rounding_mode="floor")


_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
# routed experts: w1 gate, w3 up (rows [0, I) and [I, 2I) of our gate_up), w2 down
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.w([123])\.weight$")


def checkpoint_name(name: str) -> str | None:
    """Our parameter for a checkpoint tensor that maps one to one; None: not one (a routed
    expert's, see `load_checkpoint`, or not ours: MTP layers). Raises on an unknown name."""
    name = name.removeprefix("model.")
    if name.startswith("mtp.") or _EXPERT_RE.match(name):
        return None
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in LAYER_NAMES:
        return f"layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    raise KeyError(f"unexpected DeepSeek-V4 tensor {name!r}")


def load_checkpoint(model: DeepseekV4LM, sd: Mapping[str, torch.Tensor]) -> None:
    """Fills every parameter of ``model`` from a checkpoint's tensors (shapes checked)."""
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    filled: dict[str, int] = {}  # our name -> elements written
    with torch.no_grad():
        for key, t in sd.items():
            name = checkpoint_name(key)
            if name is not None:
                p = ours[name]
                if tuple(p.shape) != tuple(t.shape):
                    raise ValueError(f"{key}: shape {tuple(t.shape)}, expected {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))
                filled[name] = filled.get(name, 0) + t.numel()
                continue
            m = _EXPERT_RE.match(key.removeprefix("model."))
            if m is None:
                continue  # MTP
            layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
            inter = model.v4.moe_intermediate_size
            bank = f"layers.{layer}.mlp.experts." + ("down" if w == "2" else "gate_up")
            dst = ours[bank][e]
            if w == "1":
                dst = dst[:inter]
            elif w == "3":
                dst = dst[inter:]
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(f"{key}: shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(t.to(dst.dtype))
            filled[bank] = filled.get(bank, 0) + t.numel()
    short = sorted(n for n, p in ours.items() if filled.get(n, 0) != p.numel())
    if short:
        raise KeyError(f"tensors missing or incomplete: {short}")
