"""Per-sequence cache state: the KV page table, the recurrent state of linear-attention layers
and a model's own state (DeepSeek-V4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class StateSnapshot(Protocol):
    """What a snapshot of a sequence's state holds (kv/snapshots.py): a copy of itself, and
    its size for the snapshots' budget."""

    @property
    def nbytes(self) -> int: ...

    def clone(self) -> StateSnapshot: ...


class ModelState(StateSnapshot, Protocol):
    """A model's own per-sequence state beside the KV pages (DeepSeek-V4's windows' keys and
    open compressor windows: ``models.deepseek_v4_model.V4SeqState``), typed here without
    importing the model package, which sits above this one. Replaced, never changed in place,
    by each forward: a clone is a snapshot."""

    num_tokens: int

    def clone(self) -> ModelState: ...


@dataclass
class RecurrentState:
    """Gated-DeltaNet state of one sequence, for every linear-attention layer.

    conv [num_linear_layers, conv_dim, kernel - 1]   the last inputs of the causal conv
    ssm  [num_linear_layers, v_heads, k_dim, v_dim]  the delta-rule state matrix
    """

    conv: torch.Tensor
    ssm: torch.Tensor

    def clone(self) -> RecurrentState:
        return RecurrentState(self.conv.clone(), self.ssm.clone())

    @property
    def nbytes(self) -> int:
        return (
            self.conv.numel() * self.conv.element_size()
            + self.ssm.numel() * self.ssm.element_size()
        )


@dataclass
class SeqState:
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose KV / state is in the cache
    recurrent: RecurrentState | None = None
    # DeepSeek-V4: the sequence's attention state beside its pages (windows' keys, open
    # compressor windows; models/deepseek_v4_model.py), replaced by each forward; None for
    # the other families
    v4: ModelState | None = None

    def snapshot_state(self) -> StateSnapshot | None:
        """The state a prefix-cache snapshot holds (the KV pages aside): the DeltaNet state, or
        the model's own (DeepSeek-V4); None: the KV pages alone resume the sequence."""
        return self.recurrent if self.recurrent is not None else self.v4
