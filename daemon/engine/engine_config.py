"""The engine's settings (``EngineConfig``): what ``LLM`` is built with, from keyword arguments
(the offline API, ``LLM(model, backend, kv_tokens=..., ...)``) or from the daemon's settings
(``EngineConfig.from_daemon``, the model manager's path). The steps that build an engine from
them are in engine/build.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import DaemonConfig


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Every setting of one engine but its model and MoE backend (``LLM``'s two positional
    arguments); the defaults are ``LLM``'s."""

    max_model_len: int | None = None
    """Context limit (default: the model's, at most ``kv_tokens``)."""
    kv_tokens: int | None = None
    """KV pool size in tokens over all sequences (default: 131072 with the cpu backend; with
    fused/offload/hybrid the pool is on the accelerator, by default a quarter of the memory the
    dense weights leave there, engine/placement.py)."""
    page_size: int = 16
    """Tokens per KV page."""
    max_batch: int = 32
    """Requests decoded together (the continuous batch)."""
    max_step_tokens: int = 512
    """Tokens one engine step runs at most (prefill chunks and decode rows)."""
    mixed_step_budget: float | None = 0.0
    """Beside decode rows, a prompt chunk sized so the step takes about this many times a
    decode-only step (engine/pacing.py; measured step times, so the chunks depend on timing).
    0 (the default here): chunks fill ``max_step_tokens``, the same plan on every run, and an
    offline batch prefills at full speed. None (the daemon's default, ``--mixed-step-budget``):
    by the backend (``build.step_budget``): its streams' inter-token latency bounded on the
    cpu backend, where it was measured."""
    threads: int | None = None
    """CPU threads of the expert and dense kernels (default: theirs)."""
    moe_slots: int | None = None
    """Expert slots on the accelerator (offload / hybrid; default: what fits the device's free
    memory, see ``SlotBudget``)."""
    accelerator: str = "auto"
    """auto | standin (CPU stand-in, for tests) | cuda | fake-cuda (the real CUDA code path on a
    simulated card of ``vram_mib`` MiB, no data)."""
    vram_mib: int | None = None
    """The simulated card of ``fake-cuda`` (required there, refused elsewhere)."""
    bandwidth: tuple[float, float] | None = None
    """(B_P, B_H) in bytes/s for the hybrid q* split (default: the stored profile)."""
    record_routing: str | Path | None = None
    """Append every step's routed expert ids to this JSONL file (cache replay)."""
    dtype: str | None = None
    """Weights' dtype in memory (default: the checkpoint's); float32 upcasts a bf16 model."""
    prefix_cache: bool = True
    """Reuse KV (radix tree) and recurrent-state snapshots across requests."""
    snapshot_policy: str = "anchors"
    """anchors | anchors:all | interval:N | none: where hybrid models save recurrent state."""
    snapshot_budget_mb: float = 256
    """Memory for recurrent-state snapshots (own LRU, apart from the KV pool)."""
    state_dir: str | Path | None = None
    """Spill snapshots (with their prefix KV) here on ``close()`` and resume from them after a
    restart (hybrid models)."""
    spill_budget_mb: float = 2048
    """Disk for spilled snapshots (least recently used files go first)."""
    spill_idle_s: float = 2.0
    """Idle seconds after which a serving loop calling ``engine.idle()`` writes new session
    snapshots to disk."""
    name: str | None = None
    """The served name (default: the folder's, or the GGUF set's)."""
    quantize_experts: str | None = None
    """Quantize a float checkpoint's routed experts at load to this format."""
    quantize: str | None = None
    """q4_k_m | q8_0 | mxfp4: a preset quantizing dense layers and experts at load
    (models/dense_quant.py); excludes ``quantize_experts``."""
    cuda_graphs: bool = False
    """Capture decode steps as CUDA graphs per batch bucket at load (engine/graphs.py)."""
    cpu_bf16_dot: bool = True
    """bf16 weights on the CPU on vdpbf16ps where the CPU has AVX512-BF16."""
    cpu_bf16_attention: bool = True
    """With ``cpu_bf16_dot`` on such a CPU, the attention over a bf16 KV pool on vdpbf16ps too
    (queries and softmax weights rounded to bf16; the prefill about 1.8x the fp32 kernel at 8k
    keys, decode about the same). The decode attention then runs its rows on the same kernel
    (native/dense/decode_attention.h), so a token's attention has the same bits in a decode
    step, a short chunk run as rows (layers/cpu_decode.CHUNK_ROWS) or a long prompt chunk: the
    batch invariance holds (tests/test_cpu_batch_invariance.py). Off: the fp32 kernels."""
    huge_pages: bool = True
    """With the ``cpu`` backend, the weights collapsed into 2 MiB transparent huge pages on a
    background thread once filled (models/hugepages.py: measured choices there)."""
    expert_cache_mb: float | None = None
    """The disk tier (experts/disk_tier.py): the routed experts stay in the file and a RAM
    cache of about this many MiB holds the ones in use, read on demand (``cpu`` backend, GGUF
    files in a block format, for now). None: the whole expert pool is read into RAM at load.
    0: the memory left once the dense weights are loaded (3/4 of RAM, within the memory cgroup's
    limit, less what the process holds and one full sequence's KV: runtime/memlimit.memory_left).
    Never fewer than top-k experts per slot class."""
    expert_read_ahead: bool = True
    """With the disk tier: each MoE layer's call starts reading the next layer's likely experts
    (its router applied to this layer's input) while it computes."""

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineConfig:
        """``LLM``'s keyword arguments; an unknown name raises the TypeError a keyword-only
        signature would."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in kwargs:
            if key not in known:
                raise TypeError(f"LLM.__init__() got an unexpected keyword argument {key!r}")
        return cls(**kwargs)

    @classmethod
    def from_daemon(
        cls,
        cfg: DaemonConfig,
        *,
        name: str | None,
        state_dir: str | Path | None,
        bandwidth: tuple[float, float] | None = None,
        quantize: str | None = None,
        quantize_experts: str | None = None,
        expert_cache_mb: float | None = None,
    ) -> EngineConfig:
        """The daemon's settings for one model. The per-model parts come from the model
        manager: ``name``, the stored ``bandwidth`` profile and the quantization that applies
        to this checkpoint (``quantize``/``quantize_experts`` only touch float ones), the disk
        tier's ``expert_cache_mb`` where the pool does not fit the host budget;
        ``state_dir`` is used only where ``spill_budget_mb`` allows spilling."""
        return cls(
            max_batch=cfg.max_batch,
            mixed_step_budget=cfg.mixed_step_budget,
            max_model_len=cfg.max_model_len,
            kv_tokens=cfg.kv_tokens,
            moe_slots=cfg.moe_slots,
            accelerator=cfg.accelerator,
            vram_mib=cfg.vram_mib,
            bandwidth=bandwidth,
            name=name,
            prefix_cache=cfg.prefix_cache,
            snapshot_policy=cfg.snapshot_policy,
            snapshot_budget_mb=cfg.snapshot_budget_mb,
            state_dir=state_dir if cfg.spill_budget_mb > 0 else None,
            spill_budget_mb=cfg.spill_budget_mb,
            spill_idle_s=cfg.spill_idle_s,
            quantize_experts=quantize_experts,
            quantize=quantize,
            cuda_graphs=cfg.cuda_graphs,
            cpu_bf16_dot=cfg.cpu_bf16_dot,
            cpu_bf16_attention=cfg.cpu_bf16_attention,
            huge_pages=cfg.huge_pages,
            expert_cache_mb=expert_cache_mb,
            expert_read_ahead=cfg.expert_read_ahead,
        )
