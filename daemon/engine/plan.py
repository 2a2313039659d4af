"""Dry run of a model on a simulated card (DESIGN §7): will this model fit my 8 GB card?

``plan_model`` reads only ``config.json``: the dense weights are built on the meta device and
the expert pool as fake (data-less) host banks, so a model can be planned before it is
downloaded. On a ``FakeCudaAccelerator`` of the card's size it then runs what the daemon runs:
the MoE backend's load, a prompt chunk through every MoE layer and decode steps, with the real
CUDA code path; device bytes are counted (the CUDA context included) and an allocation beyond
the card fails as it would on the GPU. Host RAM is what the daemon keeps resident: the dense
weights, the expert pool (and its bf16 copy when a quantized pool is computed on the device),
the KV pool and the snapshot budget.

Dense layers and the KV pool stay on the host for now (the placement work moves them), so the
plan says ``cpu`` for them and counts the host syncs this costs per decode step.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MIB = 1 << 20
PROMPT_TOKENS = 512  # the engine's default step budget: one prefill chunk
DEFAULT_KV_TOKENS = 131072  # LLM's default pool
SNAPSHOT_MIB = 256  # LLM's default snapshot budget
# MoE layers run per simulated step: every MoE layer has the same shapes, so the device peak of
# a step is reached within its first layers (the prefill stream holds two at a time); host
# syncs are counted per layer and scaled to all layers. Fake ops cost ~1 ms each on a CPU.
SIM_LAYERS = 4


@dataclass
class Plan:
    """The result; ``as_json()`` is what ``ftctl plan --json`` prints."""

    model: str
    fits: bool
    reason: str
    backend: str
    vram_mib: int
    ram_mib: int
    vram_peak_mib: float = 0.0
    ram_peak_mib: float = 0.0
    slots: int = 0
    slot_mib: float = 0.0
    kv_tokens: int = 0
    expert_format: str = "bf16"
    host_syncs_per_decode_step: float = 0.0
    placement: dict[str, str] = field(default_factory=dict)
    parts_mib: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _meta_model(cfg: Any) -> Any:
    from ..models.model import build_model

    with torch.device("meta"):
        return build_model(cfg)


def _dense_bytes(model: Any) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:  # tied embeddings count once
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def total_ram() -> int:
    """Physical memory of this machine, bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_model(
    model_dir: str | Path,
    vram_mib: int,
    ram_mib: int | None = None,
    backend: str = "auto",
    kv_tokens: int = DEFAULT_KV_TOKENS,
    decode_steps: int = 2,
) -> Plan:
    """Plans ``model_dir`` (a folder with ``config.json``) on a ``vram_mib`` card and a host of
    ``ram_mib`` (default: this machine's RAM). Raises ``ConfigError`` for a bad config."""
    from ..experts.backend import SlotBudget, moe_activation_bytes
    from ..experts.fakecuda import FakeCudaAccelerator
    from ..models.config import ModelConfig
    from ..models.model import kv_bytes_per_token

    cfg = ModelConfig.from_hf(Path(model_dir))
    ram_mib = ram_mib if ram_mib is not None else total_ram() // MIB
    model = _meta_model(cfg)
    kv_per_token = kv_bytes_per_token(model)
    plan = Plan(str(model_dir), True, "", backend, vram_mib, ram_mib, kv_tokens=kv_tokens)
    plan.expert_format = cfg.expert_format
    dense = _dense_bytes(model)
    kv = kv_tokens * kv_per_token
    plan.parts_mib = {"dense_weights": dense / MIB, "kv_cache": kv / MIB}
    acc = FakeCudaAccelerator(vram_mib)
    budget = SlotBudget(
        kv_bytes_per_token=kv_per_token,
        activation_bytes=moe_activation_bytes(
            PROMPT_TOKENS, cfg.top_k, cfg.hidden_size, cfg.moe_intermediate_size
        ),
    )
    try:
        with acc:
            _run(plan, cfg, acc, backend, budget, decode_steps)
    except torch.OutOfMemoryError as e:
        plan.fits, plan.reason = False, f"the card runs out of memory: {e}"
    tr = acc.tracker
    plan.vram_peak_mib = (acc.session.context_bytes + tr.peak) / MIB
    host = dense + kv + SNAPSHOT_MIB * MIB + tr.host.peak
    plan.parts_mib["expert_pool"] = tr.host.peak / MIB
    plan.ram_peak_mib = host / MIB
    if plan.fits and plan.ram_peak_mib > ram_mib:
        plan.fits = False
        plan.reason = (
            f"host RAM: {plan.ram_peak_mib:.0f} MiB needed (dense weights, expert pool, KV pool "
            f"of {kv_tokens} tokens, snapshots), {ram_mib} MiB available"
        )
    return plan


def _run(plan: Plan, cfg: Any, acc: Any, backend: str, budget: Any, steps: int) -> None:
    """Load + a prompt chunk + decode steps of the MoE backend on the fake card."""
    from ..experts.backend import create_backend
    from ..experts.banks import ActivationSpec, activation_of
    from ..experts.device_backends import FusedBackend, OffloadBackend
    from ..experts.formats import allocate

    layers, experts = cfg.num_moe_layers, cfg.num_experts
    with acc.session.fake_mode:
        banks = allocate(
            cfg.expert_format, layers * experts, cfg.hidden_size, cfg.moe_intermediate_size,
            torch.bfloat16, bias=cfg.activation == "gptoss",
        )  # fmt: skip
    for t in banks.all_tensors().values():
        acc.tracker.host.note(t)
    act = ActivationSpec(activation_of(cfg.activation))
    be: Any = create_backend(
        backend, banks, layers, experts, act, accelerator=acc, slot_budget=budget
    )
    if isinstance(be, FusedBackend):
        plan.backend, plan.slots = "fused", layers * experts
    elif isinstance(be, OffloadBackend):
        plan.backend = "hybrid" if be.hybrid else "offload"
        plan.slots = be.cache.num_slots
        plan.slot_mib = be.slot_bytes / MIB
    else:
        plan.backend = "cpu"
    plan.placement = _placement(plan.backend)
    gen = torch.Generator().manual_seed(0)
    sim = min(layers, SIM_LAYERS)

    def step(tokens: int, prefill: bool) -> None:
        x = torch.randn(tokens, cfg.hidden_size, generator=gen)
        ids = torch.rand(tokens, experts, generator=gen).topk(cfg.top_k, dim=-1).indices
        w = torch.full((tokens, cfg.top_k), 1.0 / cfg.top_k)
        be.begin_step(tokens, prefill)
        for layer in range(sim):
            be.forward(layer, x, ids, w)
        be.end_step()

    if plan.backend == "cpu":
        return  # nothing on the device; the native executor is not simulated
    step(PROMPT_TOKENS, True)
    before = acc.tracker.syncs.total
    for _ in range(steps):
        step(1, False)
    per_layer = (acc.tracker.syncs.total - before) / (steps * sim)
    plan.host_syncs_per_decode_step = per_layer * layers


def _placement(backend: str) -> dict[str, str]:
    experts_dev = {"fused": "cuda", "cpu": "cpu"}.get(backend, "cuda")
    return {
        "embeddings": "cpu",
        "attention": "cpu",
        "router": "cpu",
        "norms": "cpu",
        "shared_experts": "cpu",
        "lm_head": "cpu",
        "kv_cache": "cpu",
        "expert_pool": "cpu",  # the host pool: source of truth, pinned
        "expert_slots": experts_dev,
    }
