"""Helpers of the fake-CUDA tier: model geometries with fake (data-less) host banks, and a
driver that runs a backend through load, a prompt, decode steps and resizes on the fake card."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from freetokend.experts.backend import SlotBudget, create_backend
from freetokend.experts.banks import ActivationSpec, ExpertBanks
from freetokend.experts.fakecuda import FakeCudaAccelerator

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int  # MoE layers
    experts: int
    top_k: int
    hidden: int
    inter: int

    @property
    def expert_bytes(self) -> int:  # bf16 gate_up + down
        return 3 * self.hidden * self.inter * 2


TINY = Geometry("tiny", layers=3, experts=8, top_k=2, hidden=64, inter=32)
# Qwen3-30B-A3B's MoE layer geometry, few layers
# (8 of its 48 MoE layers: 9 GiB of experts, more than an 8 GiB card, less than 24 GiB)
QWEN3_30B = Geometry("qwen3-30b-a3b", layers=8, experts=128, top_k=8, hidden=2048, inter=768)


def fake_banks(acc: FakeCudaAccelerator, g: Geometry, layers: int | None = None) -> ExpertBanks:
    n = (layers or g.layers) * g.experts
    s = acc.session
    return ExpertBanks(
        s.host_empty((n, 2 * g.inter, g.hidden), torch.bfloat16),
        s.host_empty((n, g.hidden, g.inter), torch.bfloat16),
    )


def routes(g: Geometry, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Real host ids [T, K] (distinct per token) and weights, as a router on the host gives."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, g.experts, generator=gen).topk(g.top_k, dim=-1).indices
    return ids, torch.full((tokens, g.top_k), 1.0 / g.top_k)


@dataclass
class CycleReport:
    load_bytes: int = 0
    peak: int = 0
    syncs_per_decode_step: float = 0.0  # batch 1 (the per-route kernels)
    syncs_batched_step: float = 0.0  # the last decode batch (> 16 routes: grouped compute)
    resized: tuple[int, ...] = ()  # slot counts resized to
    resize_peaks: list[int] = field(default_factory=list)
    backend: object = None


def run_cycle(
    acc: FakeCudaAccelerator,
    g: Geometry,
    backend: str,
    *,
    prompt: int = 512,
    decode_steps: int = 2,
    batched: int = 4,
    resize: bool = False,
    moe_slots: int | None = None,
) -> CycleReport:
    """Inside ``with acc:``: builds the backend, runs a prompt of ``prompt`` tokens through every
    MoE layer, ``decode_steps`` steps of one sequence, one step of ``batched`` sequences, then (slot
    backends, ``resize``) a resize down to two layers' experts and back up."""
    from freetokend.engine.resize import resize_expert_slots

    tr, rep = acc.tracker, CycleReport()
    be = create_backend(
        backend, fake_banks(acc, g), g.layers, g.experts, ActivationSpec(),
        accelerator=acc, moe_slots=moe_slots, slot_budget=SlotBudget(),
    )  # fmt: skip
    rep.load_bytes = tr.sweep()
    x = torch.randn(prompt, g.hidden)
    ids, w = routes(g, prompt)
    be.begin_step(prompt, prefill=True)
    for layer in range(g.layers):
        out = be.forward(layer, x, ids, w)
        assert out.shape == (prompt, g.hidden) and out.device.type == "cpu"
    be.end_step()
    rep.syncs_per_decode_step = _decode(be, g, 1, decode_steps, tr)
    rep.syncs_batched_step = _decode(be, g, batched, 1, tr)
    rep.peak = tr.peak
    if resize:  # down to two layers' experts, back up to the size it had
        rep.resized = (2 * g.experts, be.cache.num_slots)  # type: ignore[attr-defined]
    for n in rep.resized:
        tr.reset_peak()
        resize_expert_slots(be, n)  # type: ignore[arg-type]
        rep.resize_peaks.append(tr.peak)
    rep.peak = max([rep.peak, *rep.resize_peaks])
    rep.backend = be
    return rep


def _decode(be: object, g: Geometry, batch: int, steps: int, tr: object) -> float:
    """Runs ``steps`` decode steps of ``batch`` sequences; returns host syncs per step."""
    x = torch.randn(batch, g.hidden)
    syncs = tr.syncs.total  # type: ignore[attr-defined]
    for step in range(steps):
        ids, w = routes(g, batch, seed=step + 1)
        be.begin_step(batch)  # type: ignore[attr-defined]
        for layer in range(g.layers):
            assert be.forward(layer, x, ids, w).shape == (batch, g.hidden)  # type: ignore[attr-defined]
        be.end_step()  # type: ignore[attr-defined]
    return (tr.syncs.total - syncs) / steps  # type: ignore[attr-defined]
