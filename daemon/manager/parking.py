"""Parking the ``fused`` backend: its device copy of every expert is dropped while the model is
inactive and copied back from the host pool (``LLM.banks``) when it becomes active again, so
switching back reads no weight file."""

from __future__ import annotations

import torch

from ..experts.banks import ExpertBanks
from ..experts.device_backends import FusedBackend


def _fused(moe: object) -> FusedBackend | None:
    inner = getattr(moe, "inner", moe)
    return inner if isinstance(inner, FusedBackend) else None


def park_fused(moe: object) -> None:
    be = _fused(moe)
    if be is None or not hasattr(be, "dev"):
        return
    del be.dev
    if be.acc.device.type == "cuda":
        torch.cuda.empty_cache()


def unpark_fused(moe: object, host: ExpertBanks) -> None:
    be = _fused(moe)
    if be is None or hasattr(be, "dev"):
        return
    be.dev = FusedBackend(host, be.num_experts, be.act, be.acc).dev
