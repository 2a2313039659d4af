"""MoE backends: who computes the routed experts of a MoE layer (ARCHITECTURE §4.5).

Every backend implements one call: the gate-weighted sum of the routed experts for a batch of
tokens, returned in fp32. Backends are chosen by name only at the CLI/config boundary
(`create_backend`).
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from ..config import DISK_TIER_BACKENDS, MOE_BACKENDS
from .accelerator import Accelerator, StandinAccelerator
from .banks import ActivationSpec, ExpertBanks, moe_reference
from .device_backends import FusedBackend, OffloadBackend
from .device_tier import device_tier
from .devices import create_accelerator
from .disk_cache import slot_banks
from .disk_tier import SWITCH_S, TieredExecutor
from .fakecuda import FakeCpuExecutor, InlinePool
from .formats import dequantize_banks, dequantize_banks_to, interleaved_layout

if TYPE_CHECKING:
    from .device_backends import FusedBackend

log = logging.getLogger(__name__)
_DEFAULT_SWITCH_S = sys.getswitchinterval()  # the interpreter's (5 ms)


class MoEBackend(Protocol):
    def forward(
        self, moe_layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H]; expert_ids [T, K] (ids within the layer); weights [T, K] -> [T, H] fp32."""
        ...

    def begin_step(self, num_tokens: int, prefill: bool = False) -> None:
        """Called before a forward step of ``num_tokens`` tokens (prefill streaming starts here)."""
        ...

    def end_step(self) -> None:
        """Called after the step's last layer."""
        ...

    def known_routes(self, moe_layer: int, expert_ids: torch.Tensor) -> None:
        """Routes of a MoE layer of this step known before the step reaches it (hash-routed
        layers: the token ids decide them), expert_ids [T, K] as that layer's `forward` will get
        them. A backend may start moving those experts now; computing them waits for `forward`."""
        ...


class RoutingRecorder:
    """Wraps a backend and appends the routed ids of every (step, MoE layer) to a JSONL file, in
    the format `freetokend.experts.replay` reads: {"phase": "prefill"|"decode", "layer": L,
    "ids": [[expert ids of token 0], ...]}. A step that feeds any prompt chunk counts as prefill."""

    def __init__(self, inner: MoEBackend, path: str | Path) -> None:
        self.inner = inner
        self.path = Path(path)
        self._f = self.path.open("a", encoding="utf-8")
        self.phase = "prefill"

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def begin_step(self, num_tokens: int, prefill: bool = False) -> None:
        self.phase = "prefill" if prefill else "decode"
        self.inner.begin_step(num_tokens, prefill)

    def end_step(self) -> None:
        self.inner.end_step()
        self._f.flush()

    def known_routes(self, moe_layer: int, expert_ids: torch.Tensor) -> None:
        self.inner.known_routes(moe_layer, expert_ids)

    def forward(
        self, moe_layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        rec = {"phase": self.phase, "layer": moe_layer, "ids": expert_ids.tolist()}
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        return self.inner.forward(moe_layer, x, expert_ids, weights)

    def close(self) -> None:
        self._f.close()


class CpuBackend:
    """Experts never leave host RAM; the native executor computes them from banks of any format
    it supports (bf16/fp32, fp8_block, mxfp4, nvfp4: see cpu_executor; the GGUF block formats
    q8_0, q4_k, ... with integer dot products on ftdense's pool, whose thread count
    ``dense_native.configure`` sets: see block_executor). When the extension is not built the
    torch reference runs instead, on an fp32 dequantised copy for quantised banks."""

    def __init__(
        self,
        banks: ExpertBanks,
        num_experts: int,
        act: ActivationSpec,
        threads: int | None = None,
        fake: bool = False,
        isa: str = "auto",
    ) -> None:
        """``fake``: the banks have no data (fake device runs): a shape-checking stand-in
        replaces the native executor. ``isa``: the float executor's path (cpu_executor.ISAS;
        "avx512bf16" for ``cpu_bf16_dot``)."""
        self.num_experts = num_experts
        self.act = act
        self.executor: object | None = None
        self._dense_spin: int | None = None
        self.tier: TieredExecutor | None = None
        self._known_fids: set[int] = set()  # this step's known_routes experts (disk tier)
        # rows still being read (ExpertBanks.filling): a prompt step's layer waits for its own
        # experts, a decode step (the native decode step reads every layer) for all of them
        if fake or banks.disk is not None:
            banks.wait_filled()
        self._filling = banks.filling
        pool = banks
        if banks.disk is not None:  # experts in the file: the executor runs over RAM slots
            if fake:
                raise ValueError("the disk tier needs real banks (not a fake device's)")
            banks, classes, layer_class = slot_banks(
                pool, num_experts, banks.disk.cache_bytes, banks.disk.top_k
            )
            log.info(
                "disk tier: %d of %d experts in a RAM cache of %d MiB (%s)",
                banks.num_flat, pool.num_flat,
                sum(t.nbytes for t in banks.all_tensors().values()) >> 20, pool.format,
            )  # fmt: skip
        self.banks = banks
        if fake:
            self.executor = FakeCpuExecutor(banks)
            return
        try:
            # deferred: optional native/store module (its ImportError is handled here)
            from .block_executor import BlockExecutor, is_block_format

            if is_block_format(banks.format) and pool.disk is not None:
                # the tier's slots are empty: it interleaves each as it fills it (not 1 GB of
                # garbage at load, every page of the cache touched)
                banks.interleaved = interleaved_layout(banks)
                self.executor = BlockExecutor(banks, act)
            elif is_block_format(banks.format):  # integer dots on ftdense's shared pool
                # the cpu backend's banks are read by nothing else: interleaved in place
                self.executor = BlockExecutor(banks, act, interleave=True)
            else:
                # deferred: optional native/store module (its ImportError is handled here)
                from .cpu_executor import CpuExecutor

                self.executor = CpuExecutor(banks, act, threads=threads, isa=isa)
            # deferred: optional native/store module (its ImportError is handled here)
            from ..native import dense_native

            # every decode job on ftdense's pool; with the disk tier the cores are shared with its
            # reader threads and its Python between the jobs: a worker spinning 1 ms after each
            # takes a core from them (25 % limit of bench_disk_tier, 2-core EPYC under load 8,
            # alternated: 50 us 1.58x the decode tok/s of 1000 us, CPU a token 0.8x)
            own = isinstance(self.executor, BlockExecutor) and pool.disk is None
            self._dense_spin = dense_native.SPIN_US_OWN if own else dense_native.SPIN_US_SHARED
            self._set_spin = dense_native.set_spin
            if pool.disk is not None:
                self.tier = TieredExecutor(
                    pool.disk, pool, num_experts, banks, classes, layer_class, self.executor
                )
                self.executor = self.tier
        except (ImportError, ModuleNotFoundError) as e:
            if pool.disk is not None:
                raise RuntimeError(
                    f"the disk tier needs the native CPU expert executor ({e})"
                ) from e
            log.warning("native CPU expert executor unavailable (%s); using the torch reference", e)
            self.wait_filled()
            if banks.format != "bf16":  # moe_reference reads float banks: 4 bytes per weight
                self.banks = dequantize_banks(banks)

    @property
    def filling(self) -> bool:
        """Whether the banks' rows may still be streaming in (``ExpertBanks.filling``): a step
        that reads every layer's experts without ``forward`` (the native decode step) waits
        first (``wait_filled``)."""
        return self._filling is not None

    def wait_filled(self) -> None:
        """Returns once every expert's rows are in (``ExpertBanks.filling``)."""
        if self._filling is not None:
            self.banks.wait_filled()
            self._filling.wait()  # (the banks may be another object over the same memory)
            self._filling = None

    def begin_step(self, num_tokens: int, prefill: bool = False) -> None:
        if self._filling is not None and not prefill:
            self.wait_filled()
        self._known_fids.clear()  # known_routes' experts of the step before
        # the dense pool's spin for this model's steps (dense_native.SPIN_US_*), set every step:
        # the pool is the process's, and another resident model may have run in between
        if self._dense_spin is not None:
            self._set_spin(self._dense_spin)
        # the interpreter's thread switch likewise (disk_tier.SWITCH_S under the tier)
        switch = SWITCH_S if self.tier is not None else _DEFAULT_SWITCH_S
        if abs(sys.getswitchinterval() - switch) > 1e-7:
            sys.setswitchinterval(switch)

    def end_step(self) -> None:
        pass

    def known_routes(self, moe_layer: int, expert_ids: torch.Tensor) -> None:
        # the pool is in host RAM; the disk tier starts reading the experts it lacks
        if self.tier is not None:
            flat = expert_ids.to(torch.int32) + moe_layer * self.num_experts
            self.tier.read_known(flat, self._known_fids)

    def forward(
        self, moe_layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self._filling is not None:
            self._filling.wait_layer(moe_layer)
        return self._forward_flat(
            x, expert_ids.to(torch.int32) + moe_layer * self.num_experts, weights
        )

    def forward_flat(
        self, x: torch.Tensor, flat_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed-expert sum by flat ids [T, K] (-1 = skip the route)."""
        if self._filling is not None:  # ids of any layer
            self.wait_filled()
        return self._forward_flat(x, flat_ids, weights)

    def _forward_flat(
        self, x: torch.Tensor, flat_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self.executor is not None:
            return self.executor.forward(  # type: ignore[attr-defined]
                x.float().contiguous(),
                flat_ids.to(torch.int32).contiguous(),
                weights.float().contiguous(),
            )
        return moe_reference(x, flat_ids, weights, self.banks, self.act)


@dataclass(frozen=True)
class SlotBudget:
    """How the default slot count is sized from the device's free memory.

    kv_reserve_tokens  KV tokens kept free for the attention cache (at ``kv_bytes_per_token``)
    memory_ratio       the share of free device memory the slots and that reserve may take
                       (the rest covers activations, kernels' work buffers and fragmentation)
    kv_bytes_per_token K + V bytes of one token over all attention layers (0: KV on the host)
    activation_bytes   device bytes a step's activations and work buffers take at peak
    attention_bytes    device bytes decode attention's work buffers take at peak, at the widest
                       decode batch over the longest context (``models.model``'s
                       ``decode_attention_bytes``; 0: KV on the host)
    """

    kv_reserve_tokens: int = 8192
    memory_ratio: float = 0.9
    kv_bytes_per_token: int = 0
    activation_bytes: int = 0
    attention_bytes: int = 0

    @property
    def step_bytes(self) -> int:
        """Device bytes kept free for a step's work beyond the KV pool (and beyond
        ``memory_ratio``'s share): MoE activations (with the snapshots' budget, where the
        caller counts it there) and decode attention's work buffers. Summed, not the larger of
        the two: cheap (the attention's buffers are bounded) and safe."""
        return self.activation_bytes + self.attention_bytes


def moe_activation_bytes(tokens: int, top_k: int, hidden: int, inter: int) -> int:
    """Device bytes the MoE compute of one step of ``tokens`` tokens takes at peak (fp32): the
    per-route outputs [T*K, H], the input [T, H], one expert's weights upcast (gate_up [2I, H],
    down [H, I]) and its work rows ([T, 2I], [T, I], [T, H]) with a token in every route."""
    routes = tokens * top_k * hidden
    expert = 3 * inter * hidden
    work = tokens * (3 * inter + hidden)
    return 4 * (routes + tokens * hidden + expert + work)


def resolve_backend(
    name: str,
    accelerator: str | Accelerator = "auto",
    bandwidth: tuple[float, float] | None = None,
) -> str:
    """The concrete backend ``name`` stands for: ``auto`` is cpu without a device; with one,
    offload, upgraded to hybrid when a bandwidth profile (B_P, B_H) says the CPU branch pays
    (B_H > B_P). Other names are themselves."""

    if name not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; choose one of {', '.join(MOE_BACKENDS)}")
    if name != "auto":
        return name
    given = accelerator if isinstance(accelerator, Accelerator) else None
    no_device = (
        isinstance(given, StandinAccelerator)
        if given is not None
        else accelerator == "standin" or (accelerator == "auto" and not torch.cuda.is_available())
    )
    if no_device:
        return "cpu"
    if bandwidth is not None and bandwidth[1] > bandwidth[0]:
        return "hybrid"
    if bandwidth is None:
        log.info(
            "moe_backend auto: no bandwidth profile stored; using offload (run `ftctl bench bw`)"
        )
    return "offload"


def create_backend(
    name: str,
    banks: ExpertBanks,
    num_layers: int,
    num_experts: int,
    act: ActivationSpec,
    *,
    accelerator: str | Accelerator = "auto",
    moe_slots: int | None = None,
    bandwidth: tuple[float, float] | None = None,
    threads: int | None = None,
    slot_budget: SlotBudget | None = None,
    cpu_isa: str = "auto",
) -> MoEBackend:
    """Builds the MoE backend named at the CLI/config boundary.

    auto: no accelerator -> cpu; with one -> offload, upgraded to hybrid when a bandwidth profile
    (B_P, B_H) says the CPU branch pays (B_H > B_P). ``accelerator`` is a name or an accelerator
    object (``FakeCudaAccelerator`` for the fake device of tests and ``ftctl plan``).
    ``slot_budget``: how the default slot count (``moe_slots`` None) is sized. ``cpu_isa``: the
    CPU expert executor's path (``CpuBackend``'s isa).
    """

    name = resolve_backend(name, accelerator, bandwidth)
    given = accelerator if isinstance(accelerator, Accelerator) else None
    fake = given is not None and given.name == "fake-cuda"
    if name == "cpu":
        return CpuBackend(banks, num_experts, act, threads=threads, fake=fake, isa=cpu_isa)
    banks.wait_filled()  # copied or registered as a whole below
    if banks.disk is not None and name not in DISK_TIER_BACKENDS:
        raise ValueError(
            f"moe_backend {name} keeps every expert in device memory: the disk tier (experts "
            f"read from the file, expert_cache_mb) runs under {', '.join(DISK_TIER_BACKENDS)}; "
            "choose one of those, or drop expert_cache_mb to load the pool"
        )

    acc = given if given is not None else create_accelerator(str(accelerator))
    if name == "fused":
        return fused_backend(banks, num_experts, act, acc)
    host_format = banks.format
    num_flat = banks.num_flat
    tier = None
    if banks.disk is not None:  # the RAM cache's float slots are the host banks
        tier = device_tier(banks, num_experts)
        banks = tier.slots
    else:
        banks = accelerator_banks(banks, name)
    for t in banks.tensors().values():  # host pool filled first, registered (pinned) after
        acc.pin(t)  # (the tier's slots: allocated once, never moved: registered once)
    if moe_slots is None:
        slots = _default_slots(banks, acc, num_flat, slot_budget or SlotBudget())
    else:
        slots = moe_slots
    cpu = (
        CpuBackend(banks, num_experts, act, threads=threads, fake=fake, isa=cpu_isa)
        if name == "hybrid"
        else None
    )
    if name == "hybrid" and bandwidth is None:
        log.info(
            "hybrid: no bandwidth profile stored; q* assumes B_P = B_H until `ftctl bench bw` runs"
        )
    if isinstance(acc, StandinAccelerator):
        log.info("accelerator: CPU stand-in (no GPU): the %s mechanism runs, not for speed", name)
    be = OffloadBackend(
        banks,
        num_layers,
        num_experts,
        act,
        acc,
        slots,
        cpu=cpu,
        hybrid=name == "hybrid",
        bandwidth=bandwidth,
        tier=tier,
    )
    be.host_format = host_format
    if fake:
        be._pool = InlinePool()  # type: ignore[assignment]
    return be


def accelerator_banks(banks: ExpertBanks, backend: str) -> ExpertBanks:
    """The banks the accelerator backend ``backend`` computes from, for a host pool ``banks``
    of any format: ``banks`` themselves when float; quantized experts dequantized to bf16."""
    if banks.format == "bf16":
        return banks
    # The accelerator backends compute from float banks (moe_reference, the Triton kernels):
    # quantized experts are dequantized once (e2m1 and e8m0 values are exact in bf16), one
    # expert at a time into the bf16 banks (never a whole fp32 copy of the pool).

    log.warning(
        "moe_backend %s: %s experts are dequantized to bf16 (the cpu backend computes them "
        "packed)", backend, banks.format,
    )  # fmt: skip
    return dequantize_banks_to(banks, torch.bfloat16)


def fused_backend(
    banks: ExpertBanks, num_experts: int, act: ActivationSpec, acc: Accelerator
) -> FusedBackend:
    """The ``fused`` backend of host pool ``banks`` (any format) on ``acc``: every expert on the
    device in the format it computes from (``accelerator_banks``). Load builds it so, and so
    does unparking a parked one (manager/parking.py), from the host pool that stays packed."""

    return FusedBackend(accelerator_banks(banks, "fused"), num_experts, act, acc)


def _default_slots(banks: ExpertBanks, acc: Accelerator, num_flat: int, budget: SlotBudget) -> int:
    """Slots that fit the device: ``memory_ratio`` of its free memory (what already lives there
    is not free), less the KV reserve and a step's work (``step_bytes``), over one slot's bytes
    (a slot holds one expert in the device format: every bank). Without a device memory limit
    (the CPU stand-in): half of all ``num_flat`` experts. At least one slot, at most every
    expert.

    Raises ``torch.OutOfMemoryError`` when not even one slot fits."""
    info = acc.mem_get_info()
    if info is None:
        return max(1, num_flat // 2)
    free = info[0]
    slot = banks.nbytes_per_expert()
    # the slot cache's own state: slot_of/freq [N] int32, per-slot maps ~21 bytes each
    state = 8 * num_flat
    reserve = budget.kv_reserve_tokens * budget.kv_bytes_per_token + budget.step_bytes
    room = int(free * budget.memory_ratio) - reserve - state
    n = room // (slot + 21)
    if n < 1:
        raise torch.OutOfMemoryError(
            f"no expert slot fits the device: {free >> 20} MiB free, {reserve >> 20} MiB kept for "
            f"KV, activations and attention work buffers, {slot >> 20} MiB per slot"
        )
    n = min(n, num_flat)
    log.info(
        "moe slots: %d (%d MiB each) from %d MiB free on the device", n, slot >> 20, free >> 20
    )
    return n
