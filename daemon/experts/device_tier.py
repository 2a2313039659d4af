"""The disk tier under a device slot cache (issue 45 item 2): disk -> RAM cache -> VRAM slots
for the ``offload`` and ``hybrid`` backends (experts/device_backends.py ``OffloadBackend``).

The RAM cache is a ``TieredExecutor`` (disk_tier.py: the same ``RamCache`` policy, the same
readers and the same flat id -> slot table) whose slots are float banks in the device format
(bf16, as ``backend.accelerator_banks`` dequantizes a resident pool): each expert read from the
file lands as GGUF rows in a staging expert of its block types and is dequantized into its slot
(``DequantReads``: the same ``dequantize`` of the same rows as the resident pool's, so a slot
holds the bits that pool's row holds). These float slots are the host banks the device fills
from (pinned as the host pool is), and in ``hybrid`` the banks the CPU branch computes from: a
disk miss is read once and serves both.

Under the tier each MoE layer's routes are read on the host once (the one host sync of the
[T, K] ids a layer, counted as ``disk_tier_syncs`` in the backend's counters; the disk read it
may start dominates it). The device's own slot cache plans the whole call unchanged, on flat
ids (the same hits, fills and CPU routes as without the tier); the call's experts are made
RAM-resident (the misses read), and the fills' sources translated to RAM slots on the device by
a table of the layer's E experts (``OffloadBackend._tier_fills``; the table goes up as
runtime/staging.to_device sends a step's metadata: page-locked, queued, no sync, and the host's
table may change after). Where the call's experts outnumber the RAM slots (a prompt, a wide
batch, a cache below a layer's experts) they are made resident a few tokens at a time
(``TieredExecutor.parts``), each part filling the experts it brings first (its copy list
compacted on the device) and running its CPU routes (hybrid) before the next part's reads; the
device computes the whole call once, after all its fills. Offload's arithmetic is then the
resident pool's at any cache size (logits equal bit for bit); hybrid's CPU rows of a call run
in parts compute in the CPU executor's smaller batches (the last bits may differ; tokens equal
in the tests).

Hazards on a real GPU, and what guards them:
- A RAM slot overwritten by a disk read while a fill still reads it (the fills are
  asynchronous: the host runs ahead to the next layer, whose misses may evict that slot).
  Each fill is recorded with the RAM slots its layer's experts hold (the fill's own copy list
  is a subset, on the device); before a read is started into a slot (``TieredExecutor.
  before_write``) the host waits for the last fill recorded on it (``Transfer.host_wait``: an
  event's synchronize on CUDA, counted by the fake-CUDA tier as an ``event`` sync; rarely
  reached: the layer's compute, queued after its fill, is what the next layer's routes come
  from, and those were read on the host already, so the fill has run by then). Fills known to
  have run (``Transfer.landed``) are dropped without waiting.
- The CPU branch reads its RAM slots in its thread; the layer waits for its result before
  returning, so no later lookup evicts them under it.
- Pinning: the slot banks are allocated once, filled by reads and registered once (they never
  move), so only the cache is pinned, not the pool.
- Prompt steps run on demand (the decode path), not through the whole-layer prefill stream:
  the stream issues the next layer's fills ahead of its routes, which would need that layer's
  every expert in RAM while this one's stay held.
- CUDA graphs: off under the tier (engine/build.capture_graphs says why): the routes' read and
  the disk reads are host work in every MoE layer.
- No host sync but the counted one: the translation table's upload is asynchronous from
  page-locked memory, the device plan is never read on the host (the zero-copy path; the copy
  lists of a split call are compacted on the device). A fill waited on before a slot's read
  (above) is a host wait on that fill's event, not a device sync, and is rare.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from queue import SimpleQueue

import torch

from .banks import ExpertBanks
from .disk_reads import READ_THREADS, ExpertSource, SlotMove, _Landing
from .disk_tier import TieredExecutor
from .formats import FORMATS, allocate, block_format, expert_rows, expert_tensors, get_format

Tensor = torch.Tensor
DEVICE_DTYPE = torch.bfloat16  # the device format's float type (backend.accelerator_banks)


def block_shapes(pool: ExpertBanks) -> tuple[int, int]:
    """(hidden, intermediate) of block banks (their rows count blocks, not inputs)."""
    if get_format(pool.format).in_blocks:
        return int(pool.down.shape[1]), int(pool.gate_up.shape[1]) // 2
    return pool.hidden_size, pool.intermediate_size


class DequantReads:
    """``SlotReads``' interface for float slots: an expert's GGUF pieces are read (on
    ``threads`` reader threads, all in flight at once) into a staging expert of its layer's
    block types, then dequantized into its float slot in the thread of its last piece; the
    staging expert is then free. ``staging`` experts per block type (a read waits for one)."""

    def __init__(
        self,
        source: ExpertSource,
        pool: ExpertBanks,
        num_experts: int,
        slots: ExpertBanks,
        threads: int = READ_THREADS,
        staging: int = 2 * READ_THREADS,
    ) -> None:
        self.source, self.slots, self.num_experts = source, slots, num_experts
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="ft-disk-tier")
        fmt = get_format(pool.format)
        pairs = list(fmt.layer_types) if fmt.layer_types is not None else [fmt.block_types]
        if any(p is None for p in pairs):
            raise ValueError(f"the disk tier reads GGUF block experts, not {pool.format}")
        self._names = [block_format(*p) for p in pairs if p is not None]  # per layer
        h, inter = block_shapes(pool)
        self._stage = {
            n: allocate(n, staging, h, inter, DEVICE_DTYPE) for n in dict.fromkeys(self._names)
        }
        self._free: dict[str, SimpleQueue[int]] = {}
        for n in self._stage:
            self._free[n] = SimpleQueue()
            for s in range(staging):
                self._free[n].put(s)
        self._move = SlotMove({"gate": None, "up": None, "down": None})  # GGUF rows as read
        self._lock = threading.Lock()

    def _name(self, fid: int) -> str:
        return self._names[min(fid // self.num_experts, len(self._names) - 1)]

    def _dest(self, name: str, s: int) -> dict[str, Tensor]:
        return {p: expert_rows(self._stage[name], p, s, 1)[0] for p in ("gate_up", "down")}

    def _dequantize(self, name: str, s: int, slot: int) -> None:
        gu, dn = FORMATS[name].dequantize(expert_tensors(self._stage[name], s))
        self.slots.gate_up[slot].copy_(gu)
        self.slots.down[slot].copy_(dn)

    def start(self, fid: int, slot: int) -> Future[int]:
        """Starts expert ``fid``'s reads into ``slot`` -> a future of its bytes read, set once
        it is dequantized into the slot (the first failure raised)."""
        name = self._name(fid)
        s = self._free[name].get()  # freed by the reader threads, never by this one
        try:
            pieces = self.source.pieces(fid, self._dest(name, s), self._move)
        except BaseException:
            self._free[name].put(s)
            raise
        read: Future[int] = Future()
        done: Future[int] = Future()
        read.add_done_callback(functools.partial(self._landed, name, s, slot, done))
        landing = _Landing(len(pieces), read)
        for piece in pieces:
            self.pool.submit(landing.run, piece)
        return done

    def _landed(self, name: str, s: int, slot: int, done: Future[int], read: Future[int]) -> None:
        try:
            n = read.result()
            self._dequantize(name, s, slot)
        except BaseException as e:  # handed to the future
            self._free[name].put(s)
            done.set_exception(e)
            return
        self._free[name].put(s)
        done.set_result(n)

    def read_now(self, fid: int, slot: int) -> int:
        """Reads expert ``fid`` into ``slot`` in the calling thread -> its bytes."""
        name = self._name(fid)
        s = self._free[name].get()
        try:
            n = sum(p() for p in self.source.pieces(fid, self._dest(name, s), self._move))
            self._dequantize(name, s, slot)
        finally:
            self._free[name].put(s)
        return n

    def close(self) -> None:
        """The readers end (the reads in flight first), then the source's descriptors."""
        self.pool.shutdown(wait=True)
        self.source.close()


def device_tier(pool: ExpertBanks, num_experts: int) -> TieredExecutor:
    """The RAM cache of float slots over the file for a device backend (see the module):
    ``pool.disk.cache_bytes`` of bf16 experts (at least top-k, at most the pool), one class."""
    disk = pool.disk
    assert disk is not None
    h, inter = block_shapes(pool)
    bias = pool.gate_up_bias is not None
    per = allocate("bf16", 1, h, inter, DEVICE_DTYPE, bias=bias, empty=_meta).nbytes_per_expert()
    n = min(pool.num_flat, max(disk.top_k, disk.cache_bytes // max(per, 1)))
    slots = allocate("bf16", n, h, inter, DEVICE_DTYPE, bias=bias)
    readers = DequantReads(disk.source, pool, num_experts, slots)
    layers = pool.num_flat // num_experts
    tier = TieredExecutor(
        disk, pool, num_experts, slots, [list(range(n))], [0] * layers, None, readers=readers
    )
    tier.read_ahead = True  # read_known only: no predictor is set (its router is the device's)
    return tier


def _meta(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")
