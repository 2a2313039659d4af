"""Parking the device state an idle model keeps beside its caches: the ``fused`` backend's
device copy of every expert is dropped while the model is inactive and built again from the
host pool (``LLM.banks``) when it becomes active again, so switching back reads no weight file;
its decode graphs (engine/graphs.py) are released with their memory pool and captured again."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..experts.backend import fused_backend
from ..experts.banks import ExpertBanks
from ..experts.device_backends import FusedBackend

if TYPE_CHECKING:
    from ..engine.runner import ModelRunner


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
    """The device experts again, built as load built them from the host pool ``host``: the
    pool of a quantized model stays packed (blocks and scales), and the device computes from
    its bf16 dequantization (experts.backend.fused_backend)."""
    be = _fused(moe)
    if be is None or hasattr(be, "dev"):
        return
    be.dev = fused_backend(host, be.num_experts, be.act, be.acc).dev


def park_graphs(runner: ModelRunner) -> None:
    """Releases the runner's decode graphs (their memory pool and scratch KV page) while the
    model is parked; ``runner.graphs`` stays, so ``unpark_graphs`` knows they were on."""
    if runner.graphs is not None:
        runner.graphs.release()


def unpark_graphs(runner: ModelRunner) -> None:
    """Captures the decode graphs again where the model had them (after its weights, experts
    and KV pool are back: the graphs read them where they now live). A failed capture leaves
    decode eager, logged (``DecodeGraphs.capture_all``)."""
    if runner.graphs is not None:
        runner.graphs.capture_all()
