"""MoE backends: who computes the routed experts of a MoE layer (DESIGN §1).

Every backend implements one call: the gate-weighted sum of the routed experts for a batch of
tokens, returned in fp32. Backends are chosen by name only at the CLI/config boundary
(`create_backend`).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from .banks import ActivationSpec, ExpertBanks, moe_reference

log = logging.getLogger(__name__)

BACKENDS = ("cpu", "fused", "offload", "hybrid", "auto")


class MoEBackend(Protocol):
    def forward(
        self, moe_layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H]; expert_ids [T, K] (ids within the layer); weights [T, K] -> [T, H] fp32."""
        ...


class RoutingRecorder:
    """Collects routed ids per (step, layer) for cache-policy replay (see experts/replay.py)."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.phase = "prefill"

    def record(self, moe_layer: int, expert_ids: torch.Tensor) -> None:
        self.records.append({"phase": self.phase, "layer": moe_layer, "ids": expert_ids.tolist()})


class CpuBackend:
    """Experts never leave host RAM; the native executor computes them (torch reference when the
    extension is not built)."""

    def __init__(self, banks: ExpertBanks, num_experts: int, act: ActivationSpec, threads: int | None = None) -> None:
        self.banks = banks
        self.num_experts = num_experts
        self.act = act
        self.recorder: RoutingRecorder | None = None
        self.executor = None
        try:
            from .cpu_executor import CpuExecutor

            self.executor = CpuExecutor(banks, act, threads=threads)
        except (ImportError, ModuleNotFoundError) as e:
            log.warning("native CPU expert executor unavailable (%s); using the torch reference", e)

    def forward(self, moe_layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.recorder is not None:
            self.recorder.record(moe_layer, expert_ids)
        flat = (expert_ids.to(torch.int32) + moe_layer * self.num_experts).contiguous()
        if self.executor is not None:
            return self.executor.forward(x.float().contiguous(), flat, weights.float().contiguous())
        return moe_reference(x, flat, weights, self.banks, self.act)


def create_backend(name: str, banks: ExpertBanks, num_experts: int, act: ActivationSpec, **kw: object) -> MoEBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name in ("cpu", "auto"):
        # No accelerator backends yet: `auto` resolves to `cpu` (the serving backend without a GPU).
        return CpuBackend(banks, num_experts, act, threads=kw.get("threads"))  # type: ignore[arg-type]
    raise NotImplementedError(f"MoE backend {name!r} needs the expert-hierarchy work (not built yet)")
