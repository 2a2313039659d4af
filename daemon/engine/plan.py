"""Dry run of a model on a simulated card (ARCHITECTURE §9.2): will this model fit my 8 GB card?

``plan_model`` reads only ``config.json``: the dense weights are built on the meta device and
the expert pool as fake (data-less) host banks, so a model can be planned before it is
downloaded. On a ``FakeCudaAccelerator`` of the card's size it then does what the daemon does at
load, with the same functions (engine/placement.py): the dense weights go to the card (bf16 where
a checkpoint is quantized; ``DenseDoesNotFit`` when they alone exceed it), the KV pool takes its
share of what is left, the MoE backend sizes its slots from the rest; then a prompt chunk and
decode steps run through the MoE layers with the real CUDA code path. Device bytes are counted
(the CUDA context included) and an allocation beyond the card fails as it would on the GPU. Host
RAM is what the daemon keeps resident: the expert pool (and its bf16 copy when a quantized pool
is computed on the device), and for the ``cpu`` backend the dense weights, KV pool and snapshots.
DeepSeek-V4 keeps its attention state per sequence beside the KV pool: what grows per token
(its compressed entries) is counted with the pool's tokens (``kv_cache``), its fixed part
(windows, open compressor windows) for ``DECODE_ROWS`` sequences as ``model_state``.

Host parts (``parts_mib``): ``expert_pool`` is the routed experts as stored (packed for a
quantized checkpoint); ``expert_pool_bf16`` the bf16 copy the device backends compute from when
the pool is quantized (``accelerator_banks``: offload and hybrid keep both on the host; the cpu
backend computes mxfp4, nvfp4 and fp8_block packed, without it). When host RAM falls short the
reason lists these parts and says what would drop one: the cpu backend (no bf16 copy), or, when
the packed pool alone exceeds the RAM, the disk tier, which exists for GGUF block experts only.

``model_dir`` may be a GGUF file: its header gives the config, as the daemon reads it. Under the
cpu, offload and hybrid backends, a GGUF of block experts whose files exceed the host budget
(three quarters of the RAM) is planned as the daemon's ``disk_tier`` "auto" runs it
(``disk_tier``): the experts stay in the file, a RAM cache holds what the budget leaves of them
(under offload and hybrid in bf16, the device format: experts/device_tier.py; the dense weights
and the KV pool on the card, the device slots as without the tier), and the plan gives the share
of a token's experts the cache holds at uniform routing, the bytes a token then reads and the
decode rate the disk's read rate bounds (given, or measured on the file: formats/disk_rate.py).

``expert_format`` (``ftctl plan --expert-format``) plans the routed experts in that format of
experts/formats.py whatever config.json's ``quantization_config`` says (which is then not
read): a checkpoint planned in another format than its own. config.json's own NVFP4 / INT4
quantization (compressed-tensors, ModelOpt: models/release_quant.py) is read as the loader
reads it, ``nvfp4`` / ``q4_0`` packed. The dense weights are planned
in bf16 either way (as the device placement holds them).

Host syncs per decode step (``host_syncs_per_decode_step``): every point where the host waits
for the device, of all kinds: reads of device data (``d2h`` copies, scalar reads, data-dependent
shapes) and blocking host -> device copies (``h2d``: a copy from pageable memory, or without
``non_blocking``, returns only once the stream has run up to it, so it stalls the host as a read
does). ``host_syncs_by_kind`` splits the figure ({"d2h": .., "h2d": ..}, and hybrid's ``event``: its
CPU branch's wait, per MoE layer, for its inputs' asynchronous copy to page-locked memory, in the
branch's own thread on a GPU, so the step's thread goes on queueing). It is the MoE layers'
syncs (measured on the simulated layers, scaled to all) plus the sampled token ids (one read);
the dense part's metadata (token ids, positions, page tables, sampling parameters) crosses in
one non-blocking copy from pinned memory (runtime/staging.py), no sync: tests/
test_fake_cuda_engine.py and test_fake_cuda_families.py count whole engine steps, h2d included.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import DISK_TIER_BACKENDS
from ..experts.backend import SlotBudget, create_backend, moe_activation_bytes, resolve_backend
from ..experts.banks import ActivationSpec, activation_of
from ..experts.device_backends import FusedBackend, OffloadBackend
from ..experts.fakecuda import FakeCudaAccelerator
from ..experts.formats import allocate, get_format
from ..formats.disk_rate import measure_disk_rate
from ..formats.gguf_file import split_files
from ..kv.pool import KVPool
from ..models.config import ModelConfig
from ..models.config_hf import from_dict, read_config, read_config_json
from ..models.loader import model_config, model_kind
from ..models.model import build_model, decode_attention_bytes, kv_bytes_per_token
from ..runtime.memlimit import TIER_WORK_RESERVE_BYTES
from .graphs import width_for
from .placement import (
    dense_device_bytes,
    device_snapshot_bytes,
    device_state_bytes,
    kv_tokens_for,
    place_dense,
    placement_of,
)

MIB = 1 << 20
PROMPT_TOKENS = 512  # the engine's default step budget: one prefill chunk
DEFAULT_KV_TOKENS = 131072  # LLM's default pool on the host (on a card: its share, placement.py)
SNAPSHOT_MIB = 256  # LLM's default snapshot budget
# the daemon's own resident memory beside its weights and KV (a disk tier's plan): its imports
# hold 165 MiB (RssAnon, measured on the 2-core EPYC), and the tokenizer, the HTTP server and
# the step's buffers take some more
RUNTIME_RESIDENT_MIB = 256
# MoE layers run per simulated step: every MoE layer has the same shapes, so the device peak of
# a step is reached within its first layers (the prefill stream holds two at a time); host
# syncs are counted per layer and scaled to all layers. Fake ops cost ~1 ms each on a CPU.
SIM_LAYERS = 4
PAGE_SIZE = 16  # the engine's default KV page
DECODE_ROWS = 32  # the engine's default max_batch: the widest decode step (graph buckets: 8)
_HOST_PARTS = ("embeddings", "attention", "norms", "router", "shared_experts", "lm_head")


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
    host_syncs_per_decode_step: float = 0.0  # all kinds (see the module docstring)
    host_syncs_by_kind: dict[str, float] = field(default_factory=dict)  # per decode step
    placement: dict[str, str] = field(default_factory=dict)
    parts_mib: dict[str, float] = field(default_factory=dict)
    disk_tier: dict[str, Any] = field(default_factory=dict)  # empty: every expert in RAM

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _meta_model(cfg: Any) -> Any:

    with torch.device("meta"):
        return build_model(cfg)


def total_ram() -> int:
    """Physical memory of this machine, bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_QUANT_KEYS = ("quantization_config", "expert_dtype")  # what --expert-format replaces


def plan_config(model_dir: str | Path, expert_format: str | None = None) -> ModelConfig:
    """The ModelConfig a plan uses: ``config.json`` as the daemon reads it; with
    ``expert_format``, read without its quantization keys and with the routed experts in that
    format (ValueError for a format experts/formats.py does not know)."""
    if model_kind(model_dir) == "gguf":  # the file's header: what the daemon reads
        cfg = model_config(model_dir)
        if expert_format is None:
            return cfg
        get_format(expert_format)  # ValueError naming the known formats
        return dataclasses.replace(cfg, expert_format=expert_format)
    if expert_format is None:
        return read_config(Path(model_dir))
    get_format(expert_format)  # ValueError naming the known formats
    raw, source = read_config_json(Path(model_dir))
    raw = {k: v for k, v in raw.items() if k not in _QUANT_KEYS}
    if isinstance(raw.get("text_config"), dict):
        raw["text_config"] = {k: v for k, v in raw["text_config"].items() if k not in _QUANT_KEYS}
    return dataclasses.replace(from_dict(raw, source=source), expert_format=expert_format)


def plan_model(
    model_dir: str | Path,
    vram_mib: int,
    ram_mib: int | None = None,
    backend: str = "auto",
    kv_tokens: int | None = None,
    decode_steps: int = 2,
    expert_format: str | None = None,
    disk_rate: float | None = None,
) -> Plan:
    """Plans ``model_dir`` (a folder with ``config.json``) on a ``vram_mib`` card and a host of
    ``ram_mib`` (default: this machine's RAM); ``kv_tokens`` None: the engine's default for the
    placement; ``expert_format``: the routed experts' format, in place of config.json's (see the
    module docstring); ``disk_rate``: the disk's read rate (bytes/s) for a disk tier's plan
    (None: measured on the file). Raises ``ConfigError`` for a bad config, ValueError for an
    unknown format or one the model's sizes do not suit."""

    cfg = plan_config(model_dir, expert_format)
    ram_mib = ram_mib if ram_mib is not None else total_ram() // MIB
    model = _meta_model(cfg)
    plan = Plan(str(model_dir), True, "", backend, vram_mib, ram_mib)
    plan.expert_format = cfg.expert_format
    acc = FakeCudaAccelerator(vram_mib)
    plan.backend = resolve_backend(backend, acc)
    dense = dense_device_bytes(model)
    try:
        with acc:
            _run(plan, cfg, model, acc, kv_tokens, decode_steps)
    except torch.OutOfMemoryError as e:  # DenseDoesNotFit included
        plan.fits, plan.reason = False, f"the card runs out of memory: {e}"
    tr = acc.tracker
    plan.vram_peak_mib = (acc.session.context_bytes + tr.peak) / MIB
    plan.parts_mib["dense_weights"] = dense / MIB
    pool = pool_bytes(cfg)
    plan.parts_mib["expert_pool"] = pool / MIB
    if tr.host.peak > pool:  # the device backends made a bf16 copy of a quantized pool
        # (the host peak also holds the transient of making it: one expert's fp32 work)
        plan.parts_mib["expert_pool_bf16"] = pool_bytes(cfg, "bf16") / MIB
    host = max(tr.host.peak, pool)  # the pool as stored, even where the card failed first
    if plan.backend == "cpu":  # the dense part, KV pool, model state and snapshots: the host
        kv = int((plan.parts_mib.get("kv_cache", 0) + plan.parts_mib.get("model_state", 0)) * MIB)
        host += dense + kv + SNAPSHOT_MIB * MIB
    plan.ram_peak_mib = host / MIB
    files = _tiered_files(plan, cfg, model_dir, ram_mib) if plan.fits else 0
    if files:
        _plan_disk_tier(plan, cfg, model_dir, ram_mib, files, disk_rate)
    elif plan.fits and plan.ram_peak_mib > ram_mib:
        plan.fits = False
        plan.reason = _host_ram_reason(plan, ram_mib)
    return plan


def _tiered_files(plan: Plan, cfg: Any, model_dir: str | Path, ram_mib: int) -> int:
    """The bytes of the model's files where the daemon would leave its experts in them
    (``disk_tier`` "auto": a GGUF file of block experts under a backend of
    ``DISK_TIER_BACKENDS`` whose files exceed the host budget, three quarters of the RAM:
    manager/models.expert_cache_mb, runtime/memlimit.host_pool_budget); 0 where it would
    not."""
    if plan.backend not in DISK_TIER_BACKENDS or model_kind(model_dir) != "gguf":
        return 0
    if not get_format(cfg.expert_format).in_blocks:
        return 0
    files = sum(p.stat().st_size for p in split_files(Path(model_dir)))
    return files if files > ram_mib * MIB * 3 // 4 else 0


def _plan_disk_tier(
    plan: Plan, cfg: Any, model_dir: str | Path, ram_mib: int, files: int, rate: float | None
) -> None:
    """The disk tier's plan: its RAM cache (the budget, three quarters of the RAM, less the
    dense weights, one full-length sequence's KV, the snapshots, the runtime's own memory and
    the tier's work buffers: what ``memory_left`` leaves it at load, engine/build.py), the share of a token's experts it holds under uniform
    routing (an LRU over uniformly random experts hits about its share of the pool; a real
    model's routing has locality and hits more), the bytes a token then reads and the decode
    rate the disk bounds: ``rate`` (bytes/s) or, None, the file's measured read rate. Under
    offload and hybrid the cache's slots are bf16 (the device format: experts/device_tier.py),
    the dense weights, model state and snapshots live on the card, and the host keeps one
    sequence's KV in reserve as the load does (engine/build.py); the device part is the plan's
    own (the device slots fill from the cache as from a resident pool)."""
    device = plan.backend != "cpu"
    shape = (cfg.hidden_size, cfg.moe_intermediate_size, torch.bfloat16)
    stored = get_format(cfg.expert_format).nbytes_per_expert(*shape)  # what a miss reads
    per = get_format("bf16").nbytes_per_expert(*shape) if device else stored  # a cache slot
    p = plan.parts_mib
    seq = min(plan.kv_tokens, cfg.max_position_embeddings) / max(plan.kv_tokens, 1)
    if device:
        p.pop("expert_pool_bf16", None)  # no bf16 copy of the pool: the cache is bf16
        rest = int(p["kv_cache"] * seq * MIB)
    else:
        dense = max(files - int(p["expert_pool"] * MIB), 0)  # kept in the file's blocks
        p["dense_weights"] = dense / MIB
        rest = dense + int((p["kv_cache"] * seq + p.get("model_state", 0) + SNAPSHOT_MIB) * MIB)
    rest += RUNTIME_RESIDENT_MIB * MIB + TIER_WORK_RESERVE_BYTES
    budget = ram_mib * MIB * 3 // 4
    cache = budget - rest
    pool_experts = cfg.num_moe_layers * cfg.num_experts
    slots = min(max(cache, 0) // per, pool_experts)
    tier: dict[str, Any] = {"cache_mib": slots * per / MIB, "cache_experts": slots,
                            "pool_experts": pool_experts}  # fmt: skip
    plan.disk_tier = tier
    plan.placement["expert_pool"] = "disk"
    if device:
        plan.placement["expert_ram_cache"] = "cpu (bf16, pinned)"
    else:
        plan.placement["expert_slots"] = "cpu (RAM cache)"
    plan.parts_mib["expert_ram_cache"] = slots * per / MIB
    plan.ram_peak_mib = (rest + slots * per) / MIB
    if slots < cfg.top_k:
        held = (
            "one sequence's KV, the runtime and the tier's buffers"
            if device
            else "the dense weights, one sequence's KV, the snapshots, the runtime and the "
            "tier's buffers"
        )
        plan.fits = False
        plan.reason = (
            f"the disk tier's RAM cache: {max(cache, 0) / MIB:.0f} MiB left of {budget / MIB:.0f} "
            f"MiB (three quarters of {ram_mib} MiB) after {held} ({rest / MIB:.0f} MiB), "
            f"fewer than one token's {cfg.top_k} experts of {per / MIB:.1f} MiB"
        )
        return
    if rate is None:
        first = split_files(Path(model_dir))[0]
        measured = measure_disk_rate(first)
        rate = measured.bytes_per_s
        tier["disk_rate_source"] = f"measured on {first.name}" + (
            "" if measured.direct else " (through the page cache)"
        )
    else:
        tier["disk_rate_source"] = "given"
    hit = slots / pool_experts
    missed = cfg.top_k * cfg.num_moe_layers * stored * (1 - hit)
    tier.update(
        hit_fraction=hit,
        missed_mib_per_token=missed / MIB,
        disk_read_mb_s=rate / 1e6,
        decode_tok_s_disk_bound=rate / missed if missed > 0 else None,
    )


def pool_bytes(cfg: Any, fmt: str | None = None) -> int:
    """Host bytes of the routed experts, every MoE layer's: as stored (``fmt`` None: the
    model's expert format, and the biases of GPT-OSS in bf16), or their weights in ``fmt``
    alone (the device backends' bf16 copy shares the pool's bf16 biases)."""
    per = get_format(fmt or cfg.expert_format).nbytes_per_expert(
        cfg.hidden_size, cfg.moe_intermediate_size, torch.bfloat16
    )
    if fmt is None and cfg.activation == "gptoss":
        per += (2 * cfg.moe_intermediate_size + cfg.hidden_size) * torch.bfloat16.itemsize
    return cfg.num_moe_layers * cfg.num_experts * per


def _host_ram_reason(plan: Plan, ram_mib: int) -> str:
    """What the host RAM must hold, part by part, and what would drop a part."""
    p = plan.parts_mib
    parts = [f"expert pool {p['expert_pool']:.0f} MiB as {plan.expert_format}"]
    if p.get("expert_pool_bf16"):
        parts.append(f"its bf16 copy for the device slots {p['expert_pool_bf16']:.0f} MiB")
    if plan.backend == "cpu":
        kv = p.get("kv_cache", 0) + p.get("model_state", 0)
        parts += [
            f"dense weights {p['dense_weights']:.0f} MiB",
            f"KV pool of {plan.kv_tokens} tokens {kv:.0f} MiB",
            f"snapshots {SNAPSHOT_MIB} MiB",
        ]
    reason = (
        f"host RAM: {plan.ram_peak_mib:.0f} MiB needed ({', '.join(parts)}), "
        f"{ram_mib} MiB available"
    )
    if p["expert_pool"] > ram_mib:
        return reason + (
            f"; the {plan.expert_format} expert pool alone exceeds it: only the disk tier "
            "(experts left in the file, read on demand) would hold it, and the disk tier takes "
            "GGUF experts in a block format under the cpu, offload and hybrid backends only"
        )
    if p.get("expert_pool_bf16"):
        reason += (
            f"; the cpu backend computes {plan.expert_format} experts packed, without the "
            "copy (plan it with --backend cpu)"
        )
    return reason


def _run(plan: Plan, cfg: Any, model: Any, acc: Any, kv_tokens: int | None, steps: int) -> None:
    """Load (dense placement, KV pool, MoE backend) + a prompt chunk + decode steps on the fake
    card; fills ``plan`` as it goes (what was sized before an out-of-memory error stays)."""

    layers, experts = cfg.num_moe_layers, cfg.num_experts
    kv_per_token = kv_bytes_per_token(model, PAGE_SIZE)
    on_device = plan.backend != "cpu"
    if on_device:
        placement = place_dense(model, acc)
        plan.placement = placement_of(model)
    plan.kv_tokens = kv_tokens_for(
        kv_tokens, kv_per_token, acc if on_device else None, DEFAULT_KV_TOKENS
    )
    plan.parts_mib["kv_cache"] = plan.kv_tokens * kv_per_token / MIB  # V4: its entries too
    states = DECODE_ROWS * model.state_bytes_per_seq()  # V4: windows, open compressor windows
    if states:
        plan.parts_mib["model_state"] = states / MIB
    attention = 0
    if on_device:  # decode attention's work buffers at the widest batch, longest context
        context = min(cfg.max_position_embeddings, plan.kv_tokens)
        keys = width_for(-(-context // PAGE_SIZE)) * PAGE_SIZE  # the eager step's table
        attention = decode_attention_bytes(model, DECODE_ROWS, keys, PAGE_SIZE)
        plan.parts_mib["decode_attention"] = attention / MIB
    with acc.session.fake_mode:
        banks = allocate(
            cfg.expert_format, layers * experts, cfg.hidden_size, cfg.moe_intermediate_size,
            torch.bfloat16, bias=cfg.activation == "gptoss",
        )  # fmt: skip
    for t in banks.all_tensors().values():
        acc.tracker.host.note(t)
    act = ActivationSpec(activation_of(cfg.activation))
    budget = SlotBudget(
        kv_reserve_tokens=plan.kv_tokens if on_device else 0,
        kv_bytes_per_token=kv_per_token,
        activation_bytes=moe_activation_bytes(
            PROMPT_TOKENS, cfg.top_k, cfg.hidden_size, cfg.moe_intermediate_size
        )
        + device_snapshot_bytes(model, SNAPSHOT_MIB * MIB, on_device)
        + device_state_bytes(model, DECODE_ROWS, on_device),
        attention_bytes=attention,
    )
    be: Any = create_backend(
        plan.backend, banks, layers, experts, act, accelerator=acc, slot_budget=budget
    )
    if isinstance(be, FusedBackend):
        plan.slots = layers * experts
    elif isinstance(be, OffloadBackend):
        plan.slots = be.cache.num_slots
        plan.slot_mib = be.slot_bytes / MIB
    if not on_device:
        plan.placement = {part: "cpu" for part in _HOST_PARTS}
        plan.placement.update(kv_cache="cpu", expert_pool="cpu", expert_slots="cpu")
        return  # nothing on the device; the native executor is not simulated
    heads, head_dim = model.kv_geometry
    pages = max(1, -(-plan.kv_tokens // PAGE_SIZE))
    pool = KVPool(
        model.num_attention_layers, pages, PAGE_SIZE, heads, head_dim, model.dtype,
        layer_shapes=model.kv_layer_shapes, device=placement.device,
        regions=model.pool_regions(PAGE_SIZE),
    )  # fmt: skip
    plan.placement.update(kv_cache=pool.device.type, expert_pool="cpu", expert_slots="cuda")
    if model.num_linear_layers:
        plan.placement["recurrent_state"] = placement.device.type
    if model.own_state:
        plan.placement["model_state"] = placement.device.type
    gen = torch.Generator().manual_seed(0)
    sim = min(layers, SIM_LAYERS)
    dev = placement.device

    syncs = acc.tracker.syncs
    counted: Counter[str] = Counter()

    def step(tokens: int, prefill: bool) -> None:
        # the layer's input, ids and gate weights on the device, as the placed router leaves
        # them (their copies here are the simulation's, not the step's: not counted)
        x = torch.randn(tokens, cfg.hidden_size, generator=gen).to(dev)
        ids = torch.rand(tokens, experts, generator=gen).topk(cfg.top_k, dim=-1).indices.to(dev)
        w = torch.full((tokens, cfg.top_k), 1.0 / cfg.top_k).to(dev)
        before = Counter(syncs.by_kind)
        be.begin_step(tokens, prefill)
        for layer in range(sim):
            be.forward(layer, x, ids, w)
        be.end_step()
        if not prefill:
            counted.update(Counter(syncs.by_kind) - before)

    step(PROMPT_TOKENS, True)
    for _ in range(steps):
        step(1, False)
    by_kind = {k: n / (steps * sim) * layers for k, n in counted.items()}
    by_kind["d2h"] = by_kind.get("d2h", 0.0) + 1  # + the sampled token ids
    by_kind.setdefault("h2d", 0.0)
    plan.host_syncs_by_kind = dict(sorted(by_kind.items()))
    plan.host_syncs_per_decode_step = sum(by_kind.values())
