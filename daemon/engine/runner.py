"""ModelRunner: owns the model, the KV pool and the MoE backend; runs one flat forward batch.

The KV pool and every sequence's recurrent state are allocated where the dense part runs
(``Placement.device``); the batch's token ids, positions, logits rows and page tables are sent
there in one asynchronous copy from pinned memory (``staging``: no host sync; a blocking copy
per tensor, or per attention layer for the page tables, would stall the host each time) and the
logits stay there."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..experts.backend import MoEBackend
from ..kv.pool import KVPool
from ..kv.seq_state import SeqState
from ..models.batch import ForwardBatch, SeqChunk
from ..models.deepseek_v4_model import DeepseekV4CausalLM
from ..models.layers import cpu_decode
from ..models.layers.decode_lane import DecodeLane
from ..models.layers.deltanet import GatedDeltaNet
from ..models.model import CausalLM
from ..runtime.staging import to_device
from .graphs import decode_forward, pack_decode, static_decode_blocker, width_for
from .placement import HOST, Placement

if TYPE_CHECKING:
    from .graphs import DecodeGraphs


# A step of at most this many tokens (decode rows, or a paced prompt chunk beside them,
# engine/pacing.py) runs torch's ops on one thread, as decode steps do: measured on a busy
# 2-core Zen 3 (4-layer Qwen3-30B-A3B geometry, Q4_K_M, a decode row beside a chunk at 2k
# context, steps interleaved, medians of 12): 2 / 4 / 8 / 16-token chunks 291 / 360 / 438 /
# 892 ms on torch's 2 threads, 197 / 262 / 384 / 561 ms on one (a decode step: 69 / 61 ms).
SMALL_STEP_TOKENS = 32


@contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """Runs the block with `n` torch intra-op threads (None: unchanged).

    Decode steps run torch's ops on one thread: their weight streams go through native pools
    (dense projections, experts), and what is left for torch (norms, rope, one-token attention)
    is tiny, so a parallel region only costs a wake-up, or a scheduler slice when another pool's
    worker holds the second core (measured: a 2-page KV gather 0.01 ms on 1 thread, 12 ms on 2
    on a busy 2-core machine).
    """
    prev = torch.get_num_threads()
    if n is None or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@dataclass
class Work:
    """One sequence's share of a step: feed ``tokens`` after what is cached in ``state``."""

    state: SeqState
    tokens: list[int]
    want_logits: bool = True
    all_logits: bool = False  # logits of every fed position, not only the last (LLM.logits)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        moe: MoEBackend,
        kv_tokens: int,
        page_size: int = 16,
        placement: Placement = HOST,
    ) -> None:
        cfg = model.cfg
        self.model, self.cfg, self.moe = model, cfg, moe
        self.placement = placement
        self.page_size = page_size
        num_pages = max(1, -(-kv_tokens // page_size))
        self.kv = KVPool(
            model.num_attention_layers,
            num_pages,
            page_size,
            *model.kv_geometry,
            model.dtype,
            layer_shapes=model.kv_layer_shapes,
            device=placement.device,
            regions=model.pool_regions(page_size),
        )
        # decode batches on a device run in static form (engine/graphs.py) where the model
        # has one; ``graphs`` (set by the LLM with cuda_graphs on) replays them captured
        self.static_decode = placement.on_device and static_decode_blocker(model) is None
        self.graphs: DecodeGraphs | None = None
        # decode steps of the same rows on the CPU: one native call each (layers/decode_lane.py);
        # _no_lane: the (model, KV pool, experts) a lane was refused for
        self._lane: DecodeLane | None = None
        self._no_lane: tuple[object, ...] | None = None

    def new_state(self) -> SeqState:
        st = SeqState()
        if self.model.num_linear_layers:
            st.recurrent = GatedDeltaNet.new_state(
                self.cfg, self.model.num_linear_layers, self.placement.device
            )
        if isinstance(self.model, DeepseekV4CausalLM):
            st.v4 = self.model.new_v4_state(self.placement.device)
        return st

    def pages_missing(self, state: SeqState, total_tokens: int) -> int:
        return max(0, self.kv.pages_for(total_tokens) - len(state.pages))

    def reserve(self, state: SeqState, total_tokens: int) -> None:
        """Make room for ``total_tokens`` cached tokens (raises KVPoolFull)."""
        need = self.pages_missing(state, total_tokens)
        if need:
            state.pages.extend(self.kv.alloc(need))

    def release(self, state: SeqState) -> None:
        self.kv.free(state.pages)
        state.pages = []
        state.num_tokens = 0
        if state.v4 is not None:  # recomputed from its first token, if ever
            assert isinstance(self.model, DeepseekV4CausalLM)
            state.v4 = self.model.new_v4_state(self.placement.device)

    @contextmanager
    def decode_scope(self, rows: int) -> Iterator[None]:
        """What a decode step of ``rows`` rows runs in: the MoE backend's step hooks, one torch
        thread, the placement's scope (a captured graph is captured within it too)."""
        static = hasattr(self.moe, "static_step")
        self.moe.begin_step(rows, prefill=False)
        if static:
            self.moe.static_step = True  # type: ignore[attr-defined]
        try:
            with _torch_threads(1), self.placement.scope():
                yield
        finally:
            if static:
                self.moe.static_step = False  # type: ignore[attr-defined]
            self.moe.end_step()

    def _static_decode(self, work: list[Work]) -> torch.Tensor:
        """A decode batch (one token per item, logits of each) in static form: replayed from a
        captured graph when ``graphs`` has one for it, else eagerly, the same function."""
        for w in work:
            self.reserve(w.state, w.state.num_tokens + 1)
        states, tokens = [w.state for w in work], [w.tokens[0] for w in work]
        logits = None
        if self.graphs is not None:
            with self.decode_scope(len(work)):
                logits = self.graphs.run(states, tokens)
        if logits is None:
            ps = self.kv.page_size
            pages = max(self.kv.pages_for(st.num_tokens + 1) for st in states)
            host = pack_decode(states, tokens, ps, len(work), width_for(pages))
            meta = to_device(host, self.placement.device)
            with self.decode_scope(len(work)):
                logits = decode_forward(self, meta)
        for st in states:
            st.num_tokens += 1
        return logits

    def _lane_decode(self, work: list[Work]) -> torch.Tensor | None:
        """A decode batch through the runner's lane (models/layers/decode_lane.py), or None where
        the model's forward runs it."""
        states = [w.state for w in work]
        model, kv, moe = self.model, self.kv, self.moe
        lane = self._lane
        if lane is None or not lane.fits(model, kv, moe, states):
            refused = (model, kv, moe, getattr(moe, "executor", None), cpu_decode.enabled())
            if self._no_lane is not None and all(
                a is b for a, b in zip(refused, self._no_lane, strict=True)
            ):
                return None
            lane = self._lane = DecodeLane.make(model, kv, moe, states)
            self._no_lane = refused if lane is None else None
            if lane is None:
                return None
        for st in states:
            self.reserve(st, st.num_tokens + 1)
        moe.begin_step(len(work), prefill=False)
        try:
            logits = lane.forward([w.tokens[0] for w in work])
        finally:
            moe.end_step()
        for st in states:
            st.num_tokens += 1
        return logits

    def forward(self, work: list[Work]) -> torch.Tensor:
        """Runs all work items as one batch; returns logits [num items with want_logits, vocab]."""
        decode = bool(work) and all(
            len(w.tokens) == 1 and w.want_logits and not w.all_logits for w in work
        )
        if decode and self.static_decode:
            return self._static_decode(work)
        if decode and not self.placement.on_device:
            logits = self._lane_decode(work)
            if logits is not None:
                return logits
        ids: list[int] = []
        pos: list[int] = []
        chunks: list[SeqChunk] = []
        rows: list[int] = []
        for w in work:
            n = len(w.tokens)
            self.reserve(w.state, w.state.num_tokens + n)
            chunks.append(SeqChunk(len(ids), n, w.state.num_tokens, w.state))
            pos.extend(range(w.state.num_tokens, w.state.num_tokens + n))
            ids.extend(w.tokens)
            if w.want_logits and w.all_logits:
                rows.extend(range(len(ids) - n, len(ids)))
            elif w.want_logits:
                rows.append(len(ids) - 1)
        # the step's metadata in one host tensor, one asynchronous copy (runtime/staging.py):
        # token ids | positions | logits rows | each chunk's page table
        tables = [ch.state.pages[: self.kv.pages_for(ch.context_len + ch.length)] for ch in chunks]
        meta = ids + pos + rows + [pg for t in tables for pg in t]
        dev_meta = to_device(torch.tensor(meta, dtype=torch.long), self.placement.device)
        n, b = len(ids), len(rows)
        off = 2 * n + b  # the first page table's
        for ch, t in zip(chunks, tables, strict=True):
            ch.table, off = dev_meta[off : off + len(t)], off + len(t)
        batch = ForwardBatch(
            token_ids=dev_meta[:n],
            positions=dev_meta[n : 2 * n],
            chunks=chunks,
            kv=self.kv,
            moe=self.moe,
            logits_rows=dev_meta[2 * n : 2 * n + b],
            max_position=max(pos, default=0),
        )
        prefill = any(len(w.tokens) > 1 for w in work)
        self.moe.begin_step(len(ids), prefill=prefill)
        try:
            small = len(ids) <= SMALL_STEP_TOKENS
            with _torch_threads(None if prefill and not small else 1), self.placement.scope():
                logits = self.model(batch)
        finally:
            self.moe.end_step()
        for w in work:
            w.state.num_tokens += len(w.tokens)
        return logits
