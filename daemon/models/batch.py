"""Typed contract between the scheduler/runner and the model: one flat forward batch.

Tokens of all sequences in a step are concatenated along one dimension N (prefill chunks and
decode tokens alike). Dense projections and the MoE run over all N rows at once; attention and
linear attention run per sequence chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..kv.pool import KVPool
from ..kv.seq_state import SeqState

if TYPE_CHECKING:
    from ..experts.backend import MoEBackend


@dataclass
class SeqChunk:
    start: int  # first row of this sequence in the flat batch
    length: int  # rows of this sequence in the batch
    context_len: int  # tokens already cached before this chunk (= position of the first row)
    state: SeqState
    # ``state.pages`` covering positions [0, context_len + length) as an int64 tensor on the KV
    # pool's device, sent with the step's other metadata (the runner): attention indexes the
    # pool with it, no host -> device copy per layer. None: layers use ``state.pages``.
    table: torch.Tensor | None = None


@dataclass
class DecodeMeta:
    """A batch of decode rows (one token each) in static form, on the KV pool's device: shapes
    depend only on the row count B and the page-table width W, never on context lengths, so
    one captured CUDA graph serves every step of that (B, W) (engine/graphs.py). Rows are
    0..B-1 in order (padding rows included)."""

    lens: torch.Tensor  # [B] int32 keys each row attends over, its own included (>= 1)
    slots: torch.Tensor  # [B] int64 KV row written: page * page_size + position % page_size
    tables: torch.Tensor  # [B, W] int32 page tables, padded with a valid page (masked by lens)
    rows: torch.Tensor  # [B] int32 0..B-1
    max_len: int  # W * page_size: the bound of ``lens``, fixed per (B, W)


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    chunks: list[SeqChunk]
    kv: KVPool
    moe: MoEBackend
    logits_rows: torch.Tensor  # [B] rows whose logits are wanted (usually each chunk's last)
    # the largest of ``positions``, known on the host (positions may live on a device)
    max_position: int | None = None
    # what layers derive once per batch and share (e.g. the decode rows' page tables)
    derived: dict[str, Any] = field(default_factory=dict)
    # a decode batch in static form (engine/graphs.py): attention writes and reads the pool
    # through it, on the device, instead of through ``chunks`` (host page lists)
    decode: DecodeMeta | None = None
