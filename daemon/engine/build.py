"""The steps that build an engine (``LLM``'s construction, engine/llm.py): load the weights
(quantized as asked), place the dense part, size the KV pool and the expert slots, make the MoE
backend, the model runner, the prefix reuse and the engine core, capture the decode graphs and
attach the snapshot spill. ``LLM`` runs them in order from its ``EngineConfig``
(engine/engine_config.py) and keeps what they make."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import MOE_BACKENDS
from ..experts import cpu_executor
from ..experts import devices as accelerators
from ..experts.accelerator import Accelerator
from ..experts.backend import (
    CpuBackend,
    RoutingRecorder,
    SlotBudget,
    create_backend,
    moe_activation_bytes,
    resolve_backend,
)
from ..experts.banks import ActivationSpec, activation_of
from ..formats.errors import CheckpointError
from ..formats.gguf_file import GgufFormatError, GgufHeader, read_headers, set_name
from ..kv.spill import SnapshotSpill, engine_fingerprint
from ..models.config import ModelConfig
from ..models.dense_quant import PRESETS, expert_format, quantize_dense
from ..models.expert_quant import quantize_experts_at_load
from ..models.hugepages import collapse_in_background, weight_tensors
from ..models.layers.moe import router_predictor
from ..models.loader import load_model, model_config, model_kind
from ..models.model import PAGE_SIZE, decode_attention_bytes, kv_bytes_per_token
from ..native import dense_native
from ..runtime.memlimit import (
    TIER_WORK_RESERVE_BYTES,
    memory_left,
    process_resident_bytes,
    release_free_heap,
)
from ..store import Store
from .core import EngineCore
from .engine_config import EngineConfig
from .graphs import BATCH_BUCKETS, DecodeGraphs, graphs_blocker, width_for
from .placement import (
    HOST,
    Placement,
    dense_device_bytes,
    device_snapshot_bytes,
    device_state_bytes,
    kv_tokens_for,
    place_dense,
)
from .prefix import PrefixReuse, SnapshotPolicy
from .runner import ModelRunner

log = logging.getLogger(__name__)

DEFAULT_KV_TOKENS = 131072


def _slot_budget(
    model: Any,
    cfg: ModelConfig,
    step_tokens: int,
    kv_tokens: int,
    snapshot_bytes: int,
    attention_bytes: int = 0,
    page_size: int = PAGE_SIZE,
) -> SlotBudget:
    """What the default slot count leaves free on the device: the KV pool (K + V of every
    attention layer per token, allocated after the slots; with DeepSeek-V4's entries), one
    step's MoE activations, ``snapshot_bytes`` (the state snapshots' budget when they live
    there, and the sequences' own state beside the pool) and decode attention's work buffers
    (``attention_bytes``)."""
    kv = kv_bytes_per_token(model, page_size)
    act = moe_activation_bytes(step_tokens, cfg.top_k, cfg.hidden_size, cfg.moe_intermediate_size)
    return SlotBudget(
        kv_reserve_tokens=kv_tokens,
        kv_bytes_per_token=kv,
        activation_bytes=act + snapshot_bytes,
        attention_bytes=attention_bytes,
    )


def context_limit(max_model_len: int | None, cfg: ModelConfig, kv_tokens: int) -> int:
    """The longest context served: ``max_model_len`` (default: the model's, bounded by the KV
    pool), never above the model's."""
    limit = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    return limit if max_model_len is not None else min(limit, kv_tokens)


def _decode_keys(max_len: int, page_size: int) -> int:
    """Keys of the widest page table a decode step of a ``max_len`` context runs over: the
    eager static step's power-of-two width (engine/graphs.width_for; graphs are no wider)."""

    return width_for(-(-max_len // page_size)) * page_size


def enter_fake_device(accelerator: str, vram_mib: int | None) -> Any:
    """The entered ``FakeCudaAccelerator`` for ``accelerator="fake-cuda"``, else None."""
    if accelerator != "fake-cuda":
        return None
    acc = accelerators.create_accelerator("fake-cuda", vram_mib=vram_mib)
    acc.open()  # type: ignore[attr-defined]  # the modes: per thread, see LLM._device_scope
    return acc


def cpu_isa(bf16_dot: bool, threads: int | None, bf16_attention: bool) -> str:
    """The CPU kernels' path for ``cpu_bf16_dot``: "avx512bf16" (the dense pool configured for
    it too, process-wide; the attention on it with ``cpu_bf16_attention``) where the CPU
    has AVX512-BF16, else "auto" (logged when asked for); on "auto" the dense pool leaves
    "avx512bf16" if an earlier model of this process put it there."""

    if not dense_native.available():
        return "auto"
    if bf16_dot and "avx512bf16" in cpu_executor.supported_isas():
        dense_native.configure(threads, isa="avx512bf16", bf16_attention=bf16_attention)
        log.info(
            "cpu_bf16_dot: bf16 weights on vdpbf16ps (activations rounded to bf16)%s",
            "; the attention too (queries and attention weights rounded to bf16)"
            if bf16_attention
            else "",
        )
        return "avx512bf16"
    if bf16_dot:
        log.info(
            "cpu_bf16_dot: this CPU lacks AVX512-BF16 (runs %s); the fp32-activation kernels run",
            ", ".join(cpu_executor.supported_isas()) or "no native kernels",
        )
    if dense_native.configured_isa() == "avx512bf16":
        dense_native.configure(threads, isa="auto")
    return "auto"


def check(moe_backend: str, config: EngineConfig) -> None:
    """The settings refused before anything loads."""
    if moe_backend not in MOE_BACKENDS:
        raise ValueError(
            f"unknown moe_backend {moe_backend!r}; choose one of {', '.join(MOE_BACKENDS)}"
        )
    if (config.accelerator == "fake-cuda") != (config.vram_mib is not None):
        raise ValueError("vram_mib (the simulated card) goes with accelerator 'fake-cuda'")


def served_name(model_dir: Path, gguf: bool, name: str | None) -> str:
    """``name``, else the GGUF set's name or the folder's."""
    if name:
        return name
    if gguf:
        return set_name(model_dir)
    return model_dir.name


def is_gguf(model_dir: Path) -> bool:
    """A GGUF file (or split set): config, tokenizer and template all come from its metadata."""
    return model_kind(model_dir) == "gguf"


def gguf_headers(model_dir: Path) -> list[GgufHeader]:
    """The parsed headers of a GGUF file or split set (read once per load; CheckpointError
    naming the file when one is not readable)."""
    try:
        return read_headers(model_dir)
    except GgufFormatError as e:
        raise CheckpointError(str(e)) from None


def load(
    model_dir: Path,
    config: EngineConfig,
    gguf_headers: list[GgufHeader] | None = None,
    cpu_only: bool = False,
) -> tuple[ModelConfig, Any, Any]:
    """The model's config, its dense model and its expert banks, in ``dtype`` and quantized by
    ``quantize`` (a preset) or ``quantize_experts`` (``gguf_headers``: a GGUF's headers, parsed
    once by the caller). ``cpu_only``: the banks will be the cpu backend's alone (real, not the
    fake device's; ``moe_backend`` auto too where it resolves to cpu), so block banks loaded as
    they are may be filled interleaved and the dense part stays on the host."""
    dtype, quantize, quantize_experts = config.dtype, config.quantize, config.quantize_experts
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    cfg = model_config(model_dir, dtype, gguf_headers)
    cache_mb = config.expert_cache_mb
    if cache_mb is not None and (quantize is not None or quantize_experts is not None):
        raise ValueError("the disk tier (expert_cache_mb) reads experts as the file has them: "
                         "no quantize or quantize_experts")  # fmt: skip
    cache = None if cache_mb is None else int(cache_mb * 2**20)
    as_loaded = quantize is None and quantize_experts is None and cache is None
    model, banks = load_model(
        model_dir, cfg, gguf_headers, cache, cpu_only and as_loaded, host_only=cpu_only
    )
    if quantize is not None:  # a preset: dense layers and experts (models/dense_quant.py)
        if quantize not in PRESETS:
            raise ValueError(f"quantize: {quantize!r} is not one of {', '.join(PRESETS)}")
        if quantize_experts is not None:
            raise ValueError("give quantize (a preset) or quantize_experts, not both")
        quantize_dense(model, quantize)
        if banks.format == "bf16":
            quantize_experts = expert_format(quantize, cfg.hidden_size, cfg.moe_intermediate_size)
    if quantize_experts is not None:
        banks = quantize_experts_at_load(banks, cfg, quantize_experts)
    if banks.format != cfg.expert_format:  # quantized here, or in an FTW conversion
        cfg = dataclasses.replace(cfg, expert_format=banks.format)
    return cfg, model, banks


def place(model: Any, backend: str, accelerator: str, fake_device: Any) -> Placement:
    """The host for the cpu backend; else the dense part moves to the accelerator (raises
    ``DenseDoesNotFit`` with the numbers when it cannot)."""
    if backend == "cpu":
        return HOST
    # looked up at call time, as create_backend does (tests swap in a chaos-order stand-in)
    acc: Accelerator = fake_device or accelerators.create_accelerator(accelerator)
    return place_dense(model, acc)


def budget(
    model: Any,
    cfg: ModelConfig,
    placement: Placement,
    max_model_len: int,
    kv_tokens: int,
    snapshots: int,
    config: EngineConfig,
) -> SlotBudget:
    """The slot budget: on a device, the KV pool (allocated after the slots), decode
    attention's work buffers at the widest decode batch (the engine's, or the largest graph
    bucket with its padding rows) over the longest context, and the model's own state of
    ``max_batch`` sequences beside the pool (DeepSeek-V4)."""

    on_device = placement.on_device
    page_size = config.page_size
    rows = max(config.max_batch, *BATCH_BUCKETS)
    keys = _decode_keys(max_model_len, page_size)
    attn = decode_attention_bytes(model, rows, keys, page_size) if on_device else 0
    states = device_state_bytes(model, config.max_batch, on_device)
    return _slot_budget(model, cfg, config.max_step_tokens,
                        kv_tokens if on_device else 0, snapshots + states, attn,
                        page_size)  # fmt: skip


def backend(
    name: str,
    model: Any,
    banks: Any,
    cfg: ModelConfig,
    placement: Placement,
    fake_device: Any,
    cpu_isa: str,
    slot_budget: SlotBudget,
    config: EngineConfig,
) -> Any:
    """The MoE backend over the banks (with huge pages under the cpu backend, and the routing
    recorder when asked)."""
    act = ActivationSpec(activation_of(cfg.activation), cfg.swiglu_alpha, cfg.swiglu_limit)
    acc = placement.acc
    moe = create_backend(
        name,
        banks,
        cfg.num_moe_layers,
        cfg.num_experts,
        act,
        accelerator=acc if acc is not None else (fake_device or "standin"),
        moe_slots=config.moe_slots,
        bandwidth=config.bandwidth,
        threads=config.threads,
        cpu_isa=cpu_isa,
        slot_budget=slot_budget,
    )
    if isinstance(moe, CpuBackend) and moe.tier is not None:  # the disk tier reads ahead
        moe.tier.predict = router_predictor(model)
        moe.tier.read_ahead = config.expert_read_ahead
    if config.huge_pages and isinstance(moe, CpuBackend):  # the CPU streams them
        # beside the rest of the start, once the experts' rows are all in
        filling = moe.banks.filling
        first = filling.wait if filling is not None else None
        collapse_in_background(weight_tensors(model, moe.banks), first=first)
    if config.record_routing is not None:
        moe = RoutingRecorder(moe, config.record_routing)
    return moe


@dataclass(frozen=True)
class DeviceParts:
    """What ``on_device`` makes, in the device scope."""

    backend: str
    """The MoE backend's name, ``auto`` resolved."""
    placement: Placement
    max_model_len: int
    slot_budget: SlotBudget
    cpu_isa: str
    moe: Any
    runner: ModelRunner


def on_device(
    model: Any,
    banks: Any,
    cfg: ModelConfig,
    moe_backend: str,
    config: EngineConfig,
    fake_device: Any,
) -> DeviceParts:
    """Order on a device: dense weights, then the KV pool's size from what they leave, then
    the expert slots from what is left after both (engine/placement)."""
    name = resolve_backend(moe_backend, fake_device or config.accelerator, config.bandwidth)
    placement = place(model, name, config.accelerator, fake_device)
    kv_per_token = kv_bytes_per_token(model, config.page_size)
    kv = kv_tokens_for(config.kv_tokens, kv_per_token, placement.acc,
                       DEFAULT_KV_TOKENS)  # fmt: skip
    snapshots = device_snapshot_bytes(
        model, int(config.snapshot_budget_mb * 2**20), placement.on_device
    )
    # Default context: the model's, bounded by the KV pool (default 131072 tokens on the
    # host, where pages are committed only when written; on a card, its share of VRAM).
    # Agents ask for max_tokens 32000 on top of long prompts.
    max_len = context_limit(config.max_model_len, cfg, kv)
    slots = budget(model, cfg, placement, max_len, kv, snapshots, config)
    disk = getattr(banks, "disk", None)
    if disk is not None and disk.cache_bytes == 0:  # the tier's cache: the memory left
        reserve = TIER_WORK_RESERVE_BYTES + kv_per_token * min(kv, max_len)
        release_free_heap()  # the load's freed buffers are not held (glibc keeps ~80 MB)
        disk.cache_bytes = memory_left(reserve_bytes=reserve)
        log.info(
            "disk tier: %d MiB left for the expert cache (3/4 of RAM or the memory cgroup's "
            "limit, less %d MiB held and %d MiB for one full sequence's KV and work buffers)",
            disk.cache_bytes >> 20, process_resident_bytes() >> 20, reserve >> 20,
        )  # fmt: skip
    isa = cpu_isa(config.cpu_bf16_dot, config.threads, config.cpu_bf16_attention)
    moe = backend(name, model, banks, cfg, placement, fake_device, isa, slots, config)
    runner = ModelRunner(model, moe, kv, config.page_size, placement)
    _log_placement(model, runner, kv)
    return DeviceParts(name, placement, max_len, slots, isa, moe, runner)


def _log_placement(model: Any, runner: ModelRunner, kv_tokens: int) -> None:
    if runner.placement.on_device:
        log.info(
            "placement: dense weights %d MiB, KV pool %d tokens (%d MiB) on %s",
            dense_device_bytes(model) >> 20, kv_tokens, runner.kv.nbytes >> 20,
            runner.placement.device,
        )  # fmt: skip


def capture_graphs(
    runner: ModelRunner,
    model: Any,
    backend: str,
    max_model_len: int,
    device_scope: Callable[[], AbstractContextManager[Any]],
) -> None:
    """``cuda_graphs``: decode graphs per batch bucket (engine/graphs.py), captured now;
    where they cannot be, one log line says why and decode runs eagerly."""

    blocker = graphs_blocker(backend, runner.placement.device, model)
    if blocker is None and getattr(runner.moe, "tier", None) is not None:
        blocker = "the disk tier reads each MoE layer's routes on the host (experts/device_tier)"
    if blocker is not None:
        log.info("cuda graphs: off (%s); decode runs without graphs", blocker)
        return
    graphs = DecodeGraphs(runner, runner.kv.pages_for(max_model_len))
    with device_scope():
        if graphs.capture_all():
            runner.graphs = graphs


def prefix_reuse(
    runner: ModelRunner,
    model: Any,
    config: EngineConfig,
    anchor_ids: Callable[[], dict[int, str]],
    turn_header: Callable[[], tuple[int, int] | None] = lambda: None,
) -> PrefixReuse | None:
    """The prefix cache (KV radix tree, and snapshots of the recurrent state or of a model's own
    state: DeepSeek-V4's), unless turned off."""
    if not config.prefix_cache:
        return None
    policy_text = config.snapshot_policy
    anchors = policy_text.startswith("anchors")
    policy = SnapshotPolicy.parse(
        policy_text, anchor_ids() if anchors else {}, turn_header() if anchors else None
    )
    # a model's own state (DeepSeek-V4's) resumes from snapshots, as the DeltaNet state does
    if model.own_state and config.state_dir is not None:
        log.info(
            "prefix cache: %s's state snapshots stay in memory (not spilled)", model.cfg.family
        )
    return PrefixReuse(
        runner.kv,
        model.num_linear_layers > 0 or model.own_state,
        policy,
        int(config.snapshot_budget_mb * 2**20),
        state_bytes=model.state_bytes if model.own_state else None,
    )


# The daemon's pacing where unset, by backend: 3 decode-only steps on the cpu backend (measured
# there: README "Long prompts beside decoding streams"); fixed chunks on the device backends,
# where a paced chunk's cost (its experts filled over PCIe, the whole-layer stream of long
# chunks) has not been measured.
CPU_STEP_BUDGET = 3.0


def step_budget(budget: float | None, backend: str) -> float:
    """``mixed_step_budget`` resolved: None (unset) by ``backend`` (CPU_STEP_BUDGET)."""
    if budget is not None:
        return budget
    return CPU_STEP_BUDGET if backend == "cpu" else 0.0


def engine_core(
    runner: ModelRunner,
    eos: set[int],
    max_model_len: int,
    prefix: PrefixReuse | None,
    config: EngineConfig,
    device_scope: Callable[[], AbstractContextManager[Any]],
    backend: str,
) -> EngineCore:
    """``backend``: the MoE backend's name, ``auto`` resolved (the pacing's default)."""
    engine = EngineCore(
        runner,
        eos,
        max_model_len,
        config.max_batch,
        config.max_step_tokens,
        prefix=prefix,
        spill_idle_s=config.spill_idle_s,
        mixed_step_budget=step_budget(config.mixed_step_budget, backend),
    )
    engine.device_scope = device_scope
    return engine


def attach_spill(
    prefix: PrefixReuse, state_dir: Path, budget_mb: float, model_dir: Path, cfg: ModelConfig,
    runner: ModelRunner,
) -> Any:  # fmt: skip
    """Snapshots spilled to (and resumed from) ``state_dir``; returns the opened Store."""

    store = Store(state_dir)
    fp = engine_fingerprint(model_dir, cfg.torch_dtype, runner.kv, cfg.expert_format)
    prefix.spill = SnapshotSpill(store, fp, int(budget_mb * 2**20))
    assert prefix.snapshots is not None
    prefix.snapshots.keep_prefix = True
    return store
