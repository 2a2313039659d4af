"""Accelerator MoE backends: ``fused``, ``offload`` and ``hybrid`` (ARCHITECTURE §4).

fused    every bank copied to the accelerator once; experts computed there.
offload  the accelerator holds a SlotCache of expert slots (one pool for all layers); every miss
         is filled over the transfer path before the layer computes on the accelerator.
hybrid   the same cache, but only q = clamp(round(m * B_P / B_H), 1, m) of the m misses are
         filled; the other routes run on the CPU executor concurrently (submitted first), and the
         two partial sums are added. Every route is computed exactly once, so the MoE output is the
         same math as a fully resident model.

Prefill (a prompt step of at least ``prefill_min_tokens`` tokens): each MoE layer's experts are
streamed through the slot cache (``_PrefillStream``): only the experts not resident are copied,
the next layer's while this one computes, and they stay cached for decode. With fewer than
2 x num_experts slots the step runs on demand through the decode path instead (logged once).

The disk tier (``tier``: experts left in the file, a RAM cache of float slots between it and
the device slots) runs under ``offload`` and ``hybrid``: see experts/device_tier.py.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..runtime.staging import to_device
from .accelerator import Accelerator, BankPairs, HostCopy, RowCopies, Transfer
from .banks import ActivationSpec, ExpertBanks, moe_reference
from .disk_tier import TieredExecutor
from .grouped import moe_grouped
from .hybrid_staging import STAGED_MAX_ROWS, HybridStaging, pack_cpu_inputs, unpack_cpu_inputs
from .slot_cache import FILL_ALL_Q16, STAT_NAMES, DecodePlan, EvictionPolicy, SlotCache

log = logging.getLogger(__name__)
_HOST = torch.device("cpu")

# Decode steps with at most this many routes (T * K) use the per-route GEMV kernels; larger
# batches share experts between tokens, where grouping by expert (moe_reference) reads less.
DECODE_KERNEL_MAX_ROUTES = 16


def _device_banks(acc: Accelerator, host: ExpertBanks, rows: int) -> ExpertBanks:
    def like(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else acc.empty((rows, *t.shape[1:]), t.dtype)

    gu, dn = like(host.gate_up), like(host.down)
    assert gu is not None and dn is not None
    return ExpertBanks(gu, dn, like(host.gate_up_bias), like(host.down_bias))


def _bank_pairs(dst: ExpertBanks, src: ExpertBanks) -> BankPairs:
    """(device bank, host bank) of each tensor of the format."""
    d, s = dst.tensors(), src.tensors()
    return [(d[k], s[k]) for k in d]


def _row_copies(
    dst: ExpertBanks, src: ExpertBanks, drows: list[int], srows: list[int]
) -> RowCopies:
    return [(d, s, drows, srows) for d, s in _bank_pairs(dst, src)]


def _kernel(
    x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, b: ExpertBanks, a: ActivationSpec
) -> torch.Tensor:
    """The per-route decode kernels over bank rows ``rows`` [T, K] (-1: skipped), read on the
    device: [T, H] fp32."""
    # deferred: triton (the ftkernels GPU kernels)
    from ftkernels.ops import moe_decode

    return moe_decode(
        x, rows.int(), weights, b.gate_up, b.down, b.gate_up_bias, b.down_bias,
        int(a.kind), a.alpha, a.limit,
    )  # fmt: skip


class FusedBackend:
    """All experts resident on the accelerator."""

    def __init__(
        self, banks: ExpertBanks, num_experts: int, act: ActivationSpec, acc: Accelerator
    ) -> None:
        self.acc, self.num_experts, self.act = acc, num_experts, act
        self.dev = _device_banks(acc, banks, banks.num_flat)
        self.static_step = False  # a static decode step (engine/graphs.py, set by the runner):
        # the per-route kernels at any route count, never moe_grouped's host read of counts
        rows = list(range(banks.num_flat))
        acc.copy_rows(_row_copies(self.dev, banks, rows, rows)).wait()

    def begin_step(self, num_tokens: int, prefill: bool = False) -> None:
        pass

    def end_step(self) -> None:
        pass

    def known_routes(self, moe_layer: int, expert_ids: torch.Tensor) -> None:
        pass  # every expert is resident

    def forward(
        self, moe_layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        dev, e = self.acc.device, self.num_experts
        # ids and gate weights come from the router, wherever it ran: the compute is on `dev`
        flat = expert_ids.to(dev).long() + moe_layer * e
        xd, wd = x.to(dev), weights.to(dev)
        if dev.type == "cuda" and (self.static_step or flat.numel() <= DECODE_KERNEL_MAX_ROUTES):
            out = _kernel(xd, flat, wd, self.dev, self.act)  # no host read of the ids
        else:
            out = moe_grouped(xd, flat, wd, self.dev, self.act, moe_layer * e, e)
        return self.acc.to_host(out, x.device)


class OffloadBackend:
    """Slot cache on the accelerator; ``hybrid=True`` splits misses with the CPU executor."""

    def __init__(
        self,
        banks: ExpertBanks,
        num_layers: int,
        num_experts: int,
        act: ActivationSpec,
        acc: Accelerator,
        num_slots: int,
        cpu: object | None = None,
        hybrid: bool = False,
        bandwidth: tuple[float, float] | None = None,
        policy: EvictionPolicy = EvictionPolicy.LRU,
        prefill_min_tokens: int = 32,
        prefill_overlap: bool = True,
        device_kernels: bool | None = None,
        tier: TieredExecutor | None = None,
    ) -> None:
        """``tier``: the disk tier's RAM cache (device_tier.device_tier), whose float slots
        ``banks`` are: the device fills from them, the CPU branch computes from them."""
        num_flat = num_layers * num_experts if tier is not None else banks.num_flat
        if not 1 <= num_slots <= num_flat:
            raise ValueError(f"moe_slots must be in [1, {num_flat}], got {num_slots}")
        self.host, self.acc, self.act = banks, acc, act
        self.tier = tier
        # the fills issued under the tier, in order, with the RAM slots their layer's experts
        # held: a read into one of those slots waits for the fill first (``_before_write``)
        self._ram_fills: list[tuple[Transfer, set[int]]] = []
        if tier is not None:
            tier.before_write = self._before_write
        self.num_layers, self.num_experts = num_layers, num_experts
        self.cpu = cpu  # a CpuBackend-like object with .forward_flat(x, flat_ids, weights)
        self.hybrid = hybrid
        self.cache = SlotCache(num_layers, num_experts, num_slots, policy, device=acc.device)
        b_p, b_h = bandwidth or (1.0, 1.0)
        self.cache.set_fill_policy(b_p, b_h, fill_all=not hybrid)
        self.slots = _device_banks(acc, banks, num_slots)
        self.prefill_min_tokens = prefill_min_tokens
        self.prefill_overlap = prefill_overlap
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-cpu-branch")
        self._staging = HybridStaging(acc)
        self._prefill: _PrefillStream | None = None
        self._warned_fallback = False
        self.static_step = False  # a static decode step (engine/graphs.py, set by the runner):
        # the per-route kernels at any route count, never moe_grouped's host read of counts
        # Decode fills from the device-side copy list (no host sync): always on the stand-in
        # (its worker runs the torch reference), on CUDA when the zero-copy check passes.
        # ``device_kernels``: the Triton fill and GEMV kernels (None: on CUDA only; True: also
        # on the stand-in, through the interpreter in tests; False: never).
        cuda = acc.device.type == "cuda"
        self.device_kernels = cuda if device_kernels is None else device_kernels
        self.device_fill = not cuda or acc.device_fill_ok(banks.gate_up)
        self._counters = {
            "cpu_routes": 0,
            "gpu_routes": 0,
            "prefill_layers_streamed": 0,
            "prefill_on_demand": 0,
            "disk_tier_syncs": 0,  # host reads of a layer's routes (the disk tier's, counted)
        }
        self._gpu_routes = torch.zeros((), dtype=torch.int64, device=acc.device)
        self._cpu_routes = torch.zeros((), dtype=torch.int64)  # host: summed without a read
        self._cpu_routes_dev = torch.zeros((), dtype=torch.int64, device=acc.device)  # staged
        self.host_format = banks.format  # the checkpoint's expert format (create_backend sets it)
        # known_routes: each prefetched layer's copies in flight and its reserved slots
        self._known: dict[int, tuple[Transfer, torch.Tensor]] = {}
        self._prefetch_stats = torch.zeros(len(STAT_NAMES), dtype=torch.int64, device=acc.device)
        self._known_fids: set[int] = set()  # this step's known_routes experts (disk tier)

    @property
    def counters(self) -> dict[str, int]:
        """Route and prefill counters (reading them syncs with the device once)."""
        return {
            **self._counters,
            "cpu_routes": self._counters["cpu_routes"]
            + int(self._cpu_routes)
            + int(self._cpu_routes_dev),
            "gpu_routes": self._counters["gpu_routes"] + int(self._gpu_routes),
            # known_routes' early lookups: hits, misses and fills (the misses it left unfilled
            # went to the layer's own lookup)
            **{
                f"prefetch_{k}": v
                for k, v in zip(STAT_NAMES[:3], self._prefetch_stats[:3].tolist(), strict=True)
            },
        }

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one slot (every bank, in the device format)."""
        return self.slots.nbytes_per_expert()

    # ---- step hooks (called by the runner) ----------------------------------------------------
    def begin_step(self, num_tokens: int, prefill: bool = False) -> None:
        self._known_fids.clear()
        for layer in list(self._known):  # left by a step that failed before its end
            self._take_known(layer)
        # only a step that feeds a prompt streams layers: a batch of 32+ decode sequences
        # routes to a few experts per layer, which the cache serves
        if not prefill or num_tokens < self.prefill_min_tokens:
            return
        if self.tier is not None:  # prompts on demand (device_tier's module docstring)
            return
        if self.cache.num_slots < 2 * self.num_experts:
            if not self._warned_fallback:
                log.warning(
                    "prefill: %d slots < 2 x %d experts; loading experts on demand",
                    self.cache.num_slots,
                    self.num_experts,
                )
                self._warned_fallback = True
            return
        self._prefill = _PrefillStream(self)

    def end_step(self) -> None:
        if self._prefill is not None:
            self._prefill.finish()
            self._prefill = None
        for layer in list(self._known):  # known routes of a layer the step did not reach
            self._take_known(layer)

    def known_routes(self, moe_layer: int, expert_ids: torch.Tensor) -> None:
        """A layer's routes known when the step starts (DeepSeek-V4's hash-routed layers: the
        token ids decide them): its lookup is planned now and its misses' copies issued, so they
        overlap the layers before it. The slots it uses stay reserved (never the victims of the
        layers in between) until the layer's own `forward`, which finds them resident; that
        lookup counts as the layer's (hits), the early plan's lookups, fills and unfilled
        misses count apart (``prefetch_*`` in `counters`). A prompt step that streams whole
        layers, or a batch of prompt size, plans nothing early. Under the disk tier the
        experts' reads into RAM start instead (ids on the host only: no sync for it)."""
        if self.tier is not None:
            if expert_ids.device.type == "cpu":
                flat_ids = expert_ids.to(torch.int32) + moe_layer * self.num_experts
                self.tier.read_known(flat_ids, self._known_fids)
            return
        if self._prefill is not None or expert_ids.shape[0] >= self.prefill_min_tokens:
            return
        if moe_layer in self._known:
            return
        st = self.cache.state
        flat = expert_ids.to(self.acc.device).long() + moe_layer * self.num_experts
        before = st.stats.clone()
        plan = self.cache.decode_step(flat.to(torch.int32), moe_layer)
        st.visits[moe_layer] -= 1  # the layer's own lookup counts its visit
        delta = st.stats - before
        st.stats.sub_(delta)  # the counters of the layer's own lookup stay as without this
        self._prefetch_stats += delta
        slots = plan.slot_ids.reshape(-1).long()  # -1: a miss left to that lookup
        held = (slots >= 0).to(st.reserved.dtype)
        st.reserved.scatter_reduce_(0, slots.clamp(min=0), held, "amax")
        self._known[moe_layer] = (self._fill(plan), slots)

    def _take_known(self, moe_layer: int) -> None:
        """The layer's early copies land before its compute; its slots are released."""
        known = self._known.pop(moe_layer, None)
        if known is None:
            return
        transfer, slots = known
        transfer.wait()
        st = self.cache.state
        free = (slots < 0).to(st.reserved.dtype)  # 0 where held: min() releases; 1: unchanged
        st.reserved.scatter_reduce_(0, slots.clamp(min=0), free, "amin")

    # ---- the layer call -------------------------------------------------------------------------
    def forward(
        self, moe_layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        self._take_known(moe_layer)
        flat = (expert_ids.long() + moe_layer * self.num_experts).to(torch.int32)
        if self.tier is not None:
            return self._tiered(moe_layer, x, flat, weights)
        if self._prefill is not None:
            self._counters["prefill_layers_streamed"] += 1
            dev = self.acc.device
            slot_of = self._prefill.slots_for(moe_layer)  # [E] device: expert -> slot
            ids = slot_of.long()[expert_ids.to(dev).long()]
            out = moe_grouped(
                x.to(dev), ids, weights.to(dev), self.slots, self.act, 0, self.cache.num_slots
            )
            return self.acc.to_host(out, x.device)
        if x.shape[0] >= self.prefill_min_tokens:
            self._counters["prefill_on_demand"] += 1
        return self._decode(moe_layer, x, flat, weights)

    def _tiered(
        self, layer: int, x: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """A layer under the disk tier: its routes read on the host (the one counted sync),
        then the decode path, its fills and CPU routes read from RAM slots (``_tier_fills``)."""
        assert self.tier is not None
        if flat.device.type != "cpu":
            self._counters["disk_tier_syncs"] += 1
        host = self.acc.to_host(flat, _HOST)  # (the fake card's: zeros)
        if x.shape[0] >= self.prefill_min_tokens:
            self._counters["prefill_on_demand"] += 1
        return self._decode(layer, x, flat, weights, (host, self.tier.parts(host)))

    def _tier_fills(
        self,
        layer: int,
        x: torch.Tensor,
        weights: torch.Tensor,
        plan: DecodePlan,
        host: torch.Tensor,
        parts: list[tuple[int, int]],
    ) -> Future[torch.Tensor] | torch.Tensor | None:
        """The layer's fills from RAM slots, and its CPU routes (hybrid) submitted -> the CPU
        branch's future, its result, or None. The device plan is the whole call's (the same
        hits, fills and CPU routes as without the tier); its experts are made RAM-resident a
        part at a time where they outnumber the RAM slots (``parts``: token ranges), each part
        filling the experts it brings that no part before filled (its copy list compacted on
        the device, no sync) and running its CPU rows before the next part's reads may evict
        its slots. The fill sources: the layer's flat id -> RAM slot table, on the device."""
        tier, e = self.tier, self.num_experts
        assert tier is not None
        first, dev = layer * e, self.acc.device
        cpu = self._cpu_possible(host.numel())
        future: Future[torch.Tensor] | None = None
        rows: list[torch.Tensor] = []  # the CPU rows of the parts before (several parts)
        done: set[int] = set()
        for a, b in parts:
            if future is not None:  # the part before's CPU routes end before its slots may go
                rows.append(future.result().clone())  # (a staged output buffer: reused)
            _, held = tier.resident(host[a:b])
            table = tier.slot_table(first, e)
            if len(parts) > 1:
                mine = {f for f in host[a:b].reshape(-1).tolist() if f >= 0} - done
                done |= mine
                keep = torch.zeros(e, dtype=torch.bool)
                keep[[f - first for f in mine]] = True
                table = torch.where(keep, table, -1)
            src = plan.copy_src_flat.long() - first
            src = torch.where(src >= 0, to_device(table, dev)[src.clamp(min=0)], -1).int()
            dst, count = plan.copy_dst_slot, plan.num_copies
            if len(parts) > 1:
                dst, src, count = compact_copies(dst, src, count)
            if cpu:  # submitted first: it runs while the fills and the device compute proceed
                future = self._submit_cpu(x[a:b], weights[a:b], plan.cpu_ids[a:b])
            fill = self._fill_from_host(self.slots, dst, src, count)
            self._ram_fills = [r for r in self._ram_fills if not r[0].landed()]
            self._ram_fills.append((fill, held))
            fill.wait()
        if len(parts) == 1 or future is None:
            return future
        return torch.cat([*rows, future.result()])

    def _before_write(self, slots: list[int]) -> None:
        """A disk read is about to overwrite RAM ``slots``: the fills that may read them land
        first (the last one recorded on them, and with it all before it: one stream); fills
        that have run (an event's query: no wait) are dropped first."""
        self._ram_fills = [r for r in self._ram_fills if not r[0].landed()]
        want = set(slots)
        last = -1
        for i, (_, held) in enumerate(self._ram_fills):
            if not want.isdisjoint(held):
                last = i
        if last >= 0:
            self._ram_fills[last][0].host_wait()
            del self._ram_fills[: last + 1]

    def _decode(
        self,
        layer: int,
        x: torch.Tensor,
        flat: torch.Tensor,
        weights: torch.Tensor,
        ram: tuple[torch.Tensor, list[tuple[int, int]]] | None = None,
    ) -> torch.Tensor:
        """One MoE layer of a decode step. The host never reads the plan unless a route may go
        to the CPU (hybrid, or more routes than free slots): the fills run from the device-side
        copy list and, with device kernels, the GEMVs read the slot ids on the device.
        ``ram`` (the disk tier): the call's flat ids on the host and its parts (``_tiered``)."""
        dev = self.acc.device
        plan = self.cache.decode_step(flat.to(dev), layer)
        cpu_future: Future[torch.Tensor] | torch.Tensor | None = None
        if ram is not None:
            cpu_future = self._tier_fills(layer, x, weights, plan, *ram)
        else:
            if self._cpu_possible(flat.numel()):
                # submitted first: it runs while the fills and the device compute proceed;
                # routes it does not own are -1 (skipped), so no host read decides whether to
                # submit
                cpu_future = self._submit_cpu(x, weights, plan.cpu_ids)
            self._fill(plan).wait()
        xd, wd = x.to(dev), weights.to(dev)
        if self.device_kernels and (self.static_step or flat.numel() <= DECODE_KERNEL_MAX_ROUTES):
            out = self._decode_kernel(xd, plan.slot_ids, wd)
        elif dev.type == "cpu":  # the stand-in
            out = moe_reference(xd, plan.slot_ids.long(), wd, self.slots, self.act)
        else:
            out = moe_grouped(xd, plan.slot_ids, wd, self.slots, self.act, 0, self.cache.num_slots)
        self._gpu_routes += (plan.slot_ids >= 0).sum()
        out = self.acc.to_host(out, x.device)
        if cpu_future is not None:  # the CPU share joins where the layer's input lives
            # from page-locked memory: the copy is queued, the host does not wait for the
            # stream (a copy from the executor's pageable output may, as a blocking one does)
            cpu = cpu_future if isinstance(cpu_future, torch.Tensor) else cpu_future.result()
            out = out + to_device(cpu, out.device)
        return out

    def _submit_cpu(
        self, x: torch.Tensor, weights: torch.Tensor, cpu_ids: torch.Tensor
    ) -> Future[torch.Tensor]:
        """Starts the CPU branch on its routes (``cpu_ids`` [T, K] on the device, -1 where the
        device owns the route); its result is [T, H] fp32 on the host.

        Dense part on the accelerator's device: its inputs cross in one asynchronous copy
        (``HybridStaging``) that the branch waits for in its own thread, and its output lands
        in a page-locked buffer. Inputs on the host (dense layers there): only the ids cross,
        in one copy, and so does a prefill layer too large for the buffers."""
        if x.device == self.acc.device and x.shape[0] <= STAGED_MAX_ROWS:
            xh, wh, ids, ready = self._staging.send(x, weights, cpu_ids)
            self._cpu_routes_dev += (cpu_ids >= 0).sum()  # read with the counters only
            out = self._staging.output(x.shape[0], x.shape[1])
            return self._pool.submit(self._cpu_staged, xh, ids, wh, ready, out)
        if x.device.type == "cpu":
            xh, wh, ids = x, weights, self.acc.to_host(cpu_ids, _HOST)
        else:  # one blocking copy, counted as a host sync
            host = self.acc.to_host(pack_cpu_inputs(x, weights, cpu_ids), _HOST)
            xh, wh, ids = unpack_cpu_inputs(host, x.shape[0], x.shape[1])
        self._cpu_routes = self._cpu_routes + (ids >= 0).sum()
        return self._pool.submit(self._cpu_part, xh, ids, wh)

    def _cpu_staged(
        self,
        x: torch.Tensor,
        cpu_ids: torch.Tensor,
        weights: torch.Tensor,
        ready: HostCopy,
        out: torch.Tensor,
    ) -> torch.Tensor:
        # the buffers were made under the step's inference mode, which is per thread
        with torch.inference_mode():
            ready.wait()  # in the branch's thread: the step's thread never waits for the copy
            out.copy_(self._cpu_part(x, cpu_ids, weights))
        return out

    def _cpu_possible(self, routes: int) -> bool:
        """Whether the plan may send a route to the CPU: hybrid splits misses by q*; offload
        only overflows when the step routes to more experts than there are unreserved slots
        (at most the layer's experts: a batch of many routes shares them)."""
        return self.hybrid or min(routes, self.num_experts) > self.cache.num_slots

    def _fill(self, plan: DecodePlan) -> Transfer:
        return self._fill_from_host(
            self.slots, plan.copy_dst_slot, plan.copy_src_flat, plan.num_copies
        )

    def _fill_from_host(
        self, slots: ExpertBanks, dst_idx: torch.Tensor, src_idx: torch.Tensor, count: torch.Tensor
    ) -> Transfer:
        """slots[dst_idx[i]] <- host[src_idx[i]] for i < count[0] (device-side int32 lists)."""
        pairs = _bank_pairs(slots, self.host)
        if self.device_fill:
            return self.acc.fill_rows(pairs, dst_idx, src_idx, count, kernel=self.device_kernels)
        # CUDA without zero-copy reads: the host learns the copy list (one sync)
        n = int(count.item())
        src = src_idx[:n].tolist()
        dst = dst_idx[:n].tolist()
        return self.acc.copy_rows([(d, s, dst, src) for d, s in pairs])

    def _decode_kernel(
        self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return _kernel(x, slot_ids, weights, self.slots, self.act)

    def _cpu_part(
        self, x: torch.Tensor, cpu_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self.tier is not None:  # flat ids -> the RAM slots (resident: ``_tiered``)
            cpu_ids = self.tier.slots_of(cpu_ids)
        if self.cpu is not None:
            return self.cpu.forward_flat(x, cpu_ids, weights)  # type: ignore[attr-defined]
        return moe_reference(x, cpu_ids.long(), weights, self.host, self.act)


def compact_copies(
    dst: torch.Tensor, src: torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A device copy list (``dst``, ``src``, ``count``) without its entries whose source is
    -1, in order, on the device (a stable sort: no host sync)."""
    keep = (src >= 0) & (torch.arange(src.shape[0], device=src.device) < count)
    order = torch.argsort((~keep).to(torch.int8), stable=True)
    return dst[order], src[order], keep.sum().to(torch.int32).reshape(1)


class _PrefillStream:
    """A prompt step streams each MoE layer's experts through the slot cache: the layer's E
    experts are looked up as one batch with every miss filled (the cache's own victims, least
    valuable first), so experts already resident are neither copied nor moved, and what was
    streamed stays cached for decode. While layer l computes, layer l + 1's misses are copied;
    layer l's slots are reserved meanwhile (never victims), which needs 2 x E slots. The plan
    and the copy list stay on the device (no host sync on the zero-copy path)."""

    def __init__(self, be: OffloadBackend) -> None:
        self.be = be
        self.pending: dict[int, Transfer] = {}
        self.maps: dict[int, torch.Tensor] = {}  # layer -> [E] int32 slot of each expert

    def _issue(self, layer: int) -> None:
        if layer >= self.be.num_layers or layer in self.pending or layer in self.maps:
            return
        be, e = self.be, self.be.num_experts
        st = be.cache.state
        flat = torch.arange(layer * e, (layer + 1) * e, dtype=torch.int32, device=be.acc.device)
        ratio, stats = st.fill_ratio.clone(), st.stats.clone()
        st.fill_ratio.fill_(FILL_ALL_Q16)  # a prompt needs every expert of the layer
        plan = be.cache.decode_step(flat.view(1, e), layer)
        st.fill_ratio.copy_(ratio)
        st.stats.copy_(stats)  # the cache's hit statistics stay those of decode
        slot_of = plan.slot_ids.view(e)
        st.reserved[slot_of.long()] = 1  # until this layer has computed
        self.maps[layer] = slot_of
        self.pending[layer] = be._fill(plan)

    def _release(self, layer: int) -> None:
        slot_of = self.maps.pop(layer, None)
        if slot_of is not None:
            self.be.cache.state.reserved[slot_of.long()] = 0

    def slots_for(self, layer: int) -> torch.Tensor:
        self._issue(layer)
        self.pending.pop(layer).wait()
        self._release(layer - 1)  # layers run in order: layer - 1 has computed
        if self.be.prefill_overlap:
            self._issue(layer + 1)
        return self.maps[layer]

    def finish(self) -> None:
        for t in self.pending.values():
            t.wait()
        self.pending.clear()
        for layer in list(self.maps):
            self._release(layer)
