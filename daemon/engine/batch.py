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
