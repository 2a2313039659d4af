"""SlotCache: one global pool of device expert slots shared by all MoE layers (ARCHITECTURE §4.2).

State (all on the cache's device, so a decode step needs no host sync and can be graph-captured):

    slot_of    [num_flat]   int32  flat_id -> slot, or -1 when not resident
    id_of_slot [num_slots]  int32  slot -> flat_id, or -1 when empty
    last_used  [num_slots]  int64  value of `step` when the slot was last hit or filled
    last_visit [num_slots]  int64  visit count of the slot's own layer when last hit or filled
    reserved   [num_slots]  int8   1 = held by a prefill layer still computing, never a victim
    freq       [num_flat]   int32  lookups of each flat id so far (saturating), resident or not
    visits     [num_layers] int64  decode steps run for each layer
    step       [1]          int64  decode steps run for any layer
    fill_ratio [1]          int32  B_P / B_H in Q16 fixed point; >= 1 << 16 means "fill every miss"
    stats      [4]          int64  hits, misses, fills, cpu routes (see STAT_NAMES)

One decode step of one layer (`decode_step_reference`, and the Triton kernel in
`ftkernels.slot_cache` that matches it bit for bit) takes the routed ids [T, K] and:
  1. dedupes them (first occurrence in row-major order owns the id) and looks each up;
  2. refreshes the hits; counts the m distinct misses;
  3. picks q = clamp(round(m * B_P / B_H), 1, m) of them to fill (q = m when filling all), capped
     by the slots the batch does not hit; misses are filled in order of first occurrence;
  4. takes the q victims in one pass: every slot gets a unique int64 key
     `(priority << idx_bits) | slot` (empty slots have priority 0; batch and reserved slots get
     KEY_MAX), and the q smallest keys win; equal priorities go to the lowest slot index;
  5. updates the maps and writes fixed-shape outputs (`DecodePlan`).
A route whose expert is neither resident nor filled gets slot -1 and its flat id in `cpu_ids`:
the caller computes it on the CPU. With too few slots for the batch even when filling all
(`offload` mode), the same happens: as many misses as fit are filled, the rest are returned in
`cpu_ids`; a caller without a CPU executor must split the batch into smaller token chunks.

Eviction policies: LRU (priority = last_used + 1) and AGED_FREQ (ours, priority =
1 + (freq << 16) // (age + 1) where age counts visits of the slot's OWN layer since it was last
used). Global LRU collapses when the budget cannot hold one token's pass through all layers: the
layer order is cyclic, so the least recently used entry belongs to the layer visited next.
Measuring age in visits of the entry's own layer removes that cyclic bias (every entry used at
its layer's last visit has age 0), and the lookup frequency ranks the entries inside an age.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import torch

FREQ_CAP = (1 << 24) - 1  # freq saturates here, so `freq << FREQ_SHIFT` stays below 2**40
FREQ_SHIFT = 16
FILL_ALL_Q16 = 1 << 16
KEY_MAX = (1 << 63) - 1
STAT_NAMES = ("hits", "misses", "fills", "cpu_routes")


class EvictionPolicy(enum.IntEnum):
    """How victims are ranked. The integer value is what the kernel receives."""

    LRU = 0
    AGED_FREQ = 1


def fill_ratio_q16(b_p: float, b_h: float, fill_all: bool = False) -> int:
    """B_P / B_H in Q16 (ARCHITECTURE §4.3 q* policy); FILL_ALL_Q16 for `offload` or when B_H <= B_P."""
    if fill_all or b_h <= b_p:
        return FILL_ALL_Q16
    return max(0, int(round(b_p / b_h * FILL_ALL_Q16)))


def idx_bits(num_slots: int) -> int:
    """Bits of the slot index in an eviction key."""
    return max(1, (num_slots - 1).bit_length())


def prio_max(num_slots: int) -> int:
    """Largest priority that still leaves the key positive and below KEY_MAX."""
    return (1 << (62 - idx_bits(num_slots))) - 1


@dataclass
class SlotState:
    """The device-side tensors of a SlotCache (shapes in the module docstring)."""

    slot_of: torch.Tensor
    id_of_slot: torch.Tensor
    last_used: torch.Tensor
    last_visit: torch.Tensor
    reserved: torch.Tensor
    freq: torch.Tensor
    visits: torch.Tensor
    step: torch.Tensor
    fill_ratio: torch.Tensor
    stats: torch.Tensor

    @classmethod
    def empty(
        cls, num_layers: int, num_experts: int, num_slots: int, device: torch.device | str = "cpu"
    ) -> SlotState:
        num_flat = num_layers * num_experts

        def full(n: int, value: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((n,), value, dtype=dtype, device=device)

        return cls(
            slot_of=full(num_flat, -1, torch.int32),
            id_of_slot=full(num_slots, -1, torch.int32),
            last_used=full(num_slots, 0, torch.int64),
            last_visit=full(num_slots, 0, torch.int64),
            reserved=full(num_slots, 0, torch.int8),
            freq=full(num_flat, 0, torch.int32),
            visits=full(num_layers, 0, torch.int64),
            step=full(1, 0, torch.int64),
            fill_ratio=full(1, FILL_ALL_Q16, torch.int32),
            stats=full(len(STAT_NAMES), 0, torch.int64),
        )

    @property
    def num_slots(self) -> int:
        return int(self.id_of_slot.shape[0])

    def clone(self) -> SlotState:
        return SlotState(**{k: v.clone() for k, v in vars(self).items()})


@dataclass
class DecodePlan:
    """Fixed-shape result of one decode step (N = T * K).

    slot_ids      [T, K] int32  slot that computes the route after the copies, or -1 (CPU)
    cpu_ids       [T, K] int32  flat id where the route goes to the CPU, else -1
    copy_src_flat [N]    int32  flat ids to copy host -> device, valid up to num_copies, then -1
    copy_dst_slot [N]    int32  their destination slots, same validity
    num_copies    [1]    int32  number of valid copies (device tensor: no host sync)
    """

    slot_ids: torch.Tensor
    cpu_ids: torch.Tensor
    copy_src_flat: torch.Tensor
    copy_dst_slot: torch.Tensor
    num_copies: torch.Tensor


def _eviction_keys(
    st: SlotState, num_experts: int, policy: EvictionPolicy, step: torch.Tensor
) -> torch.Tensor:
    """[num_slots] int64 unique keys; the smallest are the victims. Batch slots have
    last_used == step (refreshed just before), so they and reserved slots get KEY_MAX."""
    s = st.num_slots
    sid = st.id_of_slot.long()
    occupied = sid >= 0
    if policy == EvictionPolicy.LRU:
        prio = st.last_used + 1
    else:
        safe = sid.clamp(min=0)
        age = st.visits[safe // num_experts] - st.last_visit
        freq = st.freq[safe].long().clamp(max=FREQ_CAP)
        # empty slots may hold a stale last_visit from another layer: keep the divisor >= 1
        prio = 1 + torch.div(freq << FREQ_SHIFT, (age + 1).clamp(min=1), rounding_mode="floor")
    prio = torch.where(occupied, prio.clamp(max=prio_max(s)), torch.zeros_like(prio))
    key = (prio << idx_bits(s)) | torch.arange(s, device=sid.device)
    blocked = (st.last_used == step) | (st.reserved != 0)
    return torch.where(blocked, torch.full_like(key, KEY_MAX), key)


def fill_count(ratio_q16: int, m: int, n_hit: int, num_free: int) -> int:
    """q = clamp(round_half_up(m * B_P / B_H), 1, m) for m > 0, capped by `num_free - n_hit`,
    the slots this batch neither hits nor has reserved."""
    if m == 0:
        return 0
    q = min(max((m * ratio_q16 + (1 << 15)) >> 16, 1), m)
    return max(0, min(q, num_free - n_hit))


def decode_step_reference(
    st: SlotState, flat_ids: torch.Tensor, layer: int, num_experts: int, policy: EvictionPolicy
) -> DecodePlan:
    """One decode step of MoE layer `layer` in plain torch; updates `st` in place.

    flat_ids [T, K] int32 routed flat ids of this layer (-1 = padding, ignored). Works on the
    compact list of distinct ids (host-sized, so it syncs on CUDA: it is the reference).
    """
    shape = flat_ids.shape
    ids = flat_ids.reshape(-1).long()  # [N]
    n = ids.numel()
    pos = torch.arange(n, device=ids.device)
    valid = ids >= 0
    # dedupe: the first position holding an id owns it; [N, N] is small (decode batches)
    eq = (ids[:, None] == ids[None, :]) & valid[:, None]
    first = valid & (torch.where(eq, pos, n).amin(dim=1) == pos) if n else valid
    uid = ids[first]  # [U] distinct ids in order of first occurrence
    uslot = st.slot_of[uid].long()
    umiss = uslot < 0
    hit_slots, miss_ids = uslot[~umiss], uid[umiss]  # [U - m], [m]

    st.step += 1
    st.visits[layer] += 1
    step, visit = st.step[0], st.visits[layer]
    st.last_used[hit_slots] = step
    st.last_visit[hit_slots] = visit

    num_free = st.num_slots - int(st.reserved.count_nonzero())
    q = fill_count(int(st.fill_ratio[0]), miss_ids.numel(), hit_slots.numel(), num_free)
    fill_ids = miss_ids[:q]
    dst = fill_ids  # [q] victim slots, below
    if q:
        keys = _eviction_keys(st, num_experts, policy, step)
        dst = torch.topk(keys, q, largest=False, sorted=True).values
        dst = dst & ((1 << idx_bits(st.num_slots)) - 1)
        old = st.id_of_slot[dst].long()
        st.slot_of[old[old >= 0]] = -1
        st.slot_of[fill_ids] = dst.int()
        st.id_of_slot[dst] = fill_ids.int()
        st.last_used[dst] = step
        st.last_visit[dst] = visit
    st.freq[uid] = (st.freq[uid] + 1).clamp(max=FREQ_CAP)

    # after the copies every route reads its slot from the updated map; -1 = CPU
    route_slot = torch.where(valid, st.slot_of[ids.clamp(min=0)].long(), -1)
    cpu = torch.where(route_slot < 0, ids, -1)
    src_out = torch.full((n,), -1, dtype=torch.int32, device=ids.device)
    dst_out = src_out.clone()
    src_out[:q] = fill_ids.int()
    dst_out[:q] = dst.int()
    n_cpu = (cpu >= 0).sum()
    st.stats[:3] += torch.tensor([hit_slots.numel(), miss_ids.numel(), q], device=ids.device)
    st.stats[3] += n_cpu
    return DecodePlan(
        slot_ids=route_slot.int().reshape(shape),
        cpu_ids=cpu.int().reshape(shape),
        copy_src_flat=src_out,
        copy_dst_slot=dst_out,
        num_copies=torch.full((1,), q, dtype=torch.int32, device=ids.device),
    )


def decode_step(
    st: SlotState,
    flat_ids: torch.Tensor,
    layer: int,
    num_experts: int,
    policy: EvictionPolicy,
    force_kernel: bool = False,
) -> DecodePlan:
    """Dispatch: the Triton kernel on CUDA tensors (or when forced), the torch reference else."""
    if force_kernel or flat_ids.is_cuda:
        # deferred: triton (the ftkernels GPU kernels)
        from ftkernels.ops import slot_decode_step  # the kernel as a custom op

        out = slot_decode_step(
            *(getattr(st, f.name) for f in fields(st)),
            flat_ids,
            layer,
            num_experts,
            int(policy),
            idx_bits(st.num_slots),
            prio_max(st.num_slots),
            FREQ_CAP,
            FREQ_SHIFT,
            KEY_MAX,
        )
        return DecodePlan(*out)
    return decode_step_reference(st, flat_ids, layer, num_experts, policy)


class SlotCache:
    """Owner of a SlotState: configuration, the decode step and statistics."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_slots: int,
        policy: EvictionPolicy = EvictionPolicy.LRU,
        device: torch.device | str = "cpu",
        force_kernel: bool = False,
    ) -> None:
        self.num_layers, self.num_experts, self.num_slots = num_layers, num_experts, num_slots
        self.policy = policy
        self.force_kernel = force_kernel
        self.state = SlotState.empty(num_layers, num_experts, num_slots, device)

    def set_fill_policy(self, b_p: float, b_h: float, fill_all: bool = False) -> None:
        """Set q* from measured bandwidths (in place: captured graphs see the new value)."""
        self.state.fill_ratio.fill_(fill_ratio_q16(b_p, b_h, fill_all))

    def decode_step(self, flat_ids: torch.Tensor, layer: int) -> DecodePlan:
        """One decode step of `layer` for routed flat ids [T, K] (see module docstring)."""
        return decode_step(
            self.state, flat_ids, layer, self.num_experts, self.policy, self.force_kernel
        )

    def stats(self) -> dict[str, int]:
        """Read the counters (one host sync)."""
        return dict(zip(STAT_NAMES, self.state.stats.tolist(), strict=True))
