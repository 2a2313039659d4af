"""The disk tier under the host pool (ARCHITECTURE §4.7, issue 45): routed experts that do not
fit the RAM budget stay in the checkpoint file and are read on demand into a RAM cache of expert
slots.

The slots are host banks of the model's own expert format (``slot_banks``), so the CPU executors
compute over them unchanged: a MoE layer's call looks its distinct experts up in the cache
(``RamCache``: an LRU at expert granularity), reads the missing ones from the file into their
slots (disk_reads.py ``SlotReads``, ``ExpertSource.pieces``: one read per projection of an
expert, ~1 MB for Qwen3-30B-A3B's geometry, all of a call's in flight at once on a thread pool,
``O_DIRECT`` where the file system takes it: formats/direct_read.py; the reads release the GIL),
each piece moved from the read's bounce buffer straight into its slot in the cpu backend's row
interleave (as ``formats.interleave_banks`` leaves a resident pool: one pass over the bytes),
and calls the executor with slot ids in place of flat ids (a remap, as the device slot cache
does) and the flat ids as the order a token's route terms add up in (``BlockExecutor.forward``'s
``order``: the kernel sorts routes by it, not by slot). A decode call (one token) does not wait
for all its reads: it computes the experts it has while the others are read, and the missing
ones as their reads land (``TieredExecutor._overlapped``: one kernel call for what is resident,
one per batch of reads landed, route terms as rows of their own, added up in the kernel's order:
disk_rows.py). Once a call's own experts are in, the next layer's predicted ones are read ahead
while it computes (``TieredExecutor``). The same rows reach the same kernel and add up in the
same order, so the results equal a resident pool's bit for bit (at any top-k).

The native decode step (models/layers/cpu_decode.py) runs a layer whose experts are all
resident itself: ``native_tier`` gives it the slots' kernel spec and the flat id -> slot table,
it looks the routes up and computes them on the slots with no call into Python, and logs the
call; a layer with an expert missing calls the tier back. The tier applies the logged calls to
its LRU (and its counters, and its predictions' checks) at its next call, before anything else:
nothing is evicted between a logged call and then, so the cache ends as if each had called.

A call's experts are all resident at once: hits are touched before any victim is chosen, and a
call whose experts outnumber a class's slots runs a few tokens at a time (each part's experts
fit; a class holds at least top-k slots, one token's), so a victim is never an expert of the
same part. The cache grows by top-k experts at a time, so a RAM budget below one layer's
experts still runs (a model whose one layer's experts exceed the memory it may use).

Slot classes: a plain format has one class (every slot holds any expert). A per-layer GGUF format
("layers:...") keeps each layer's block types, so a slot only holds experts whose layer has its
types: the slot banks are virtual layers of top-k slots each, and each distinct pair of types
gets virtual layers in proportion to its share of the pool (at least one; the rounding's
leftover buys more where it fits).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Any

import torch

from .banks import ExpertBanks
from .disk_cache import RamCache
from .disk_predict import CooccurrencePredictor
from .disk_reads import READ_THREADS, ExpertSource, Readers, SlotReads
from .disk_rows import Rows, row_buffers

log = logging.getLogger(__name__)

Tensor = torch.Tensor
STAT_NAMES = (
    "hits", "misses", "fills", "bytes_read", "read_ahead", "read_ahead_hits", "read_ahead_wasted",
    "read_ahead_skipped",
)  # fmt: skip
# Read ahead only while the predictions are this precise (a share of the predicted experts the
# call then used, a running mean): a wasted read costs the disk as much as a needed one (random
# weights predict at chance, 8 of 128; a trained model's next-layer router far better)
READ_AHEAD_MIN_PRECISION = 0.5
PRECISION_WEIGHT = 0.1  # the running mean's weight of the newest call
# Below that precision one call in this many still predicts (to see the predictions improve):
# a prediction is the next layer's router on this layer's input, ~0.6 ms of Python and torch a
# call on the 2-core EPYC, a tenth of a tiered decode token at random routing's hit rates
CHECK_EVERY = 8
# The native decode step's log of the calls it ran on resident experts (TieredExecutor.
# native_tier): ids of so many routes a step before it calls back (a step of 48 layers, 8
# sequences and top-8 takes ~3.5k)
NATIVE_LOG = 1 << 14
# The interpreter's thread switch interval while a tiered model steps (CpuBackend.begin_step
# sets it; 5 ms, Python's, otherwise): the reader threads take the GIL around each piece (its
# read and move release it) while the step's thread runs the tier's Python, and a thread that
# asks for the GIL waits up to this long; replayed Qwen3-30B-A3B routing at the 25 % limit of
# bench_disk_tier (~32 reads a token), 2-core EPYC, one run each, interleaved: 200 us 6.68 and
# 6.48 tok/s, 5 ms 5.34 and 5.26 (read wait 93-100 ms a token against 123-127); at 50 % (~10
# reads) no difference (10.8-12.2 both)
SWITCH_S = 200e-6


@dataclass
class DiskTier:
    """The pool's experts live in ``source``; ``cache_bytes`` of RAM hold the slots; ``top_k``:
    the experts one token routes to in a layer (the fewest slots a class may have)."""

    source: ExpertSource
    cache_bytes: int
    top_k: int


class TieredExecutor:
    """A CPU expert executor over the RAM cache's slot banks (``inner``, built over ``slots``)
    that reads missing experts from ``tier.source`` before each call. The executor interface of
    the cpu backend: ``forward`` and ``forward_addresses`` (the native decode step calls the
    latter back through Python with the routed flat ids, cpu_decode.experts_of).

    Read-ahead (``predict`` set, ``read_ahead`` on): once a call's own experts are in, the
    experts ``predict(next layer, x)`` names for the next MoE layer (its router applied to this
    layer's input: models/layers/moe.py ``router_predictor``) get slots and their reads go to
    the pool, where they run while this layer computes and the next layer's attention runs (the
    kernels release the GIL); the next call waits only for those it uses and reads the rest. A
    read ahead never evicts the running call's experts. Counted: ``read_ahead`` (experts read
    ahead), ``read_ahead_hits`` (of those, used by the call they were read for, or a later one,
    before eviction) and ``read_ahead_wasted`` (evicted unused). Every prediction is checked
    against the call it was for (``precision``, a running mean of the share used); below
    ``READ_AHEAD_MIN_PRECISION`` the reads are not made (``read_ahead_skipped`` calls), the
    predictions go on (on one call in ``CHECK_EVERY``), and reading resumes when they
    improve."""

    overlap = True  # a decode call computes while its reads land (False: waits for them all)

    def __init__(
        self,
        tier: DiskTier,
        pool: ExpertBanks,
        num_experts: int,
        slots: ExpertBanks,
        classes: list[list[int]],
        layer_class: list[int],
        inner: Any,
        read_threads: int = READ_THREADS,
        read_ahead: bool = True,
        readers: Readers | None = None,
    ) -> None:
        """``readers``: how experts reach their slots (default: ``SlotReads`` of the slots'
        format; device_tier.DequantReads for float slots)."""
        self.tier, self.pool, self.slots, self.inner = tier, pool, slots, inner
        self.num_experts = num_experts
        self.num_flat = pool.num_flat  # (a property of the banks: computed each time)
        self.num_layers = self.num_flat // num_experts
        per_token = [layer_class.count(c) * tier.top_k for c in range(len(classes))]
        self.cache = RamCache(classes, lambda f: layer_class[f // num_experts], per_token)
        self._capacity = [len(c) for c in classes]  # slots per class
        # flat id + 1 -> slot (-1: not resident or still being read); 0 is the skipped route's
        self._lut = torch.full((pool.num_flat + 1,), -1, dtype=torch.int32)
        self._readers: Readers = readers or SlotReads(tier.source, slots, read_threads)
        # called with the slots about to be written, before their reads start (a device
        # backend waits there for the fills still reading them: device_tier)
        self.before_write: Callable[[list[int]], None] | None = None
        self._lock = threading.Lock()  # one call's lookup, fills and compute at a time
        self.counters = dict.fromkeys(STAT_NAMES, 0)
        self.read_seconds = 0.0  # time calls waited for reads (their own and ones read ahead)
        self.hidden_size = getattr(inner, "hidden_size", pool.hidden_size)
        self.predict: Callable[[int, Tensor], Tensor | None] | None = None
        # the read-ahead's predictions from the routing itself (disk_predict): used in place of
        # ``predict`` where set (routes that do not come from the model's routers: a replay)
        self.history: CooccurrencePredictor | None = None
        self.read_ahead = read_ahead
        self._reading: dict[int, tuple[int, Future[int]]] = {}  # fid -> (slot, its read)
        self._rows_buf: dict[str, Tensor] | None = None  # an overlapped call's rows (disk_rows)
        self._unused: set[int] = set()  # read ahead, not used yet
        self._predicted: tuple[int, set[int]] = (-1, set())  # the next layer, its predicted
        self.precision = 1.0  # the predictions' running precision (starts trusting them)
        self._doubted = 0  # calls made while the precision is below READ_AHEAD_MIN_PRECISION
        # the native decode step's calls on resident experts, touched in the LRU at the next
        # call here (native_tier): [0] entries used, then per call its ids and a -2
        self._log = torch.zeros(1 + NATIVE_LOG, dtype=torch.int32)
        self.replay: Tensor | None = None  # set_replay
        # what the native step reads of it at each call: its address (0: none), steps, layers,
        # k and the position (the session's tokens so far), one tensor for the executor's life
        self._replay_head = torch.zeros(5, dtype=torch.int64)
        # the file's descriptors and the readers go with the executor (an unloaded model)
        self._finalizer = weakref.finalize(self, self._readers.close)

    # -- the executor interface ------------------------------------------------------------------
    def forward(self, x: Tensor, flat_ids: Tensor, weights: Tensor) -> Tensor:
        with self._lock:
            self._drain()
            flat_ids = flat_ids.to(torch.int32).contiguous()
            if self.replay is not None:
                flat_ids = self._replayed(flat_ids)
            parts = self._parts(flat_ids)
            if len(parts) == 1 and flat_ids.shape[0] == 1:  # a decode step: reads overlapped
                x, weights = x.float().contiguous(), weights.float().contiguous()
                out = torch.empty(1, self.hidden_size, dtype=torch.float32)
                self._overlapped(
                    x.data_ptr(), flat_ids, weights.data_ptr(), out.data_ptr(),
                    flat_ids.shape[1], x,
                )  # fmt: skip
                return out
            if len(parts) == 1:
                ids, fids = self._remap(flat_ids)
                self._ahead(fids, x)
                return self.inner.forward(x, ids, weights, order=flat_ids)  # type: ignore[no-any-return]
            out_parts = []
            for a, b in parts:  # more experts than the slots hold: a few tokens at a time
                ids, _ = self._remap(flat_ids[a:b])
                out_parts.append(self.inner.forward(x[a:b], ids, weights[a:b], order=flat_ids[a:b]))
            return torch.cat(out_parts)

    def forward_addresses(self, x: int, ids: int, w: int, out: int, t: int, k: int) -> None:
        """``forward`` on raw addresses (models/layers/cpu_decode.py): ids [t, k] int32 (the
        native step's: already replayed where ``replay`` is set)."""
        with self._lock:
            self._drain()
            buf = (ctypes.c_int32 * (t * k)).from_address(ids)
            flat_ids = torch.frombuffer(buf, dtype=torch.int32).view(t, k)
            h = self.hidden_size
            parts = self._parts(flat_ids)
            if len(parts) > 1:
                for a, b in parts:  # as forward: rows [a, b) of x, ids, w and out (fp32)
                    slot_ids, _ = self._remap(flat_ids[a:b])
                    self.inner.forward_addresses(
                        x + 4 * a * h, slot_ids.data_ptr(), w + 4 * a * k, out + 4 * a * h,
                        b - a, k, ids + 4 * a * k,
                    )  # fmt: skip
                return
            if t == 1:
                self._overlapped(x, flat_ids, w, out, k, None)
                return
            slot_ids, fids = self._remap(flat_ids)
            if self.read_ahead and fids and (self.predict is not None or self.history is not None):
                self._ahead(fids, functools.partial(self._x_of, x, t))
            self.inner.forward_addresses(x, slot_ids.data_ptr(), w, out, t, k, ids)

    def parts(self, flat_ids: Tensor) -> list[tuple[int, int]]:
        """Token ranges of a call [T, K] whose experts fit the slots together (``_parts``)."""
        with self._lock:
            return self._parts(flat_ids.to(torch.int32))

    def resident(self, flat_ids: Tensor) -> tuple[Tensor, set[int]]:
        """A call's experts [T, K] (their ``parts`` one at a time) made resident, read where
        missing (device_tier: the device fills from the slots) -> (slot ids [T, K], -1 where
        skipped; the slots the call's experts hold). They stay until a later call's lookup."""
        with self._lock:
            self._drain()
            ids, fids = self._remap(flat_ids.to(torch.int32).contiguous())
            return ids, {self.cache.slot_of[f] for f in fids}

    def slot_table(self, first: int, count: int) -> Tensor:
        """The slots of flat ids [first, first + count) (-1: not resident), a copy."""
        with self._lock:
            return self._lut[first + 1 : first + 1 + count].clone()

    def slots_of(self, flat_ids: Tensor) -> Tensor:
        """The slots of flat ids (-1 where skipped or not resident), int32."""
        with self._lock:
            return self._lut[flat_ids.long() + 1]

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._drain()
            return {**self.counters, "hits": self.cache.hits, "misses": self.cache.misses}

    def native_tier(self) -> tuple[object, tuple[int, ...]] | None:
        """The native decode step's fast path (native/dense/bindings_decode.cpp ``TierPath``):
        (the slots' ``ftdense.QMoe``, decode_layers' ``tier`` argument), or None where the
        executor has no native spec. A layer whose experts are all resident then runs on the
        slots inside the step, with no call into Python; the step logs its ids and this
        executor touches them in its LRU (and counts them) at its next call: nothing is
        evicted in between, so the cache ends as if each had called here."""
        spec_of = getattr(self.inner, "native_spec", None)
        spec = spec_of() if spec_of is not None else None
        if spec is None:
            return None
        return spec, (
            self._lut.data_ptr(), self._log.data_ptr(), NATIVE_LOG, self.num_flat,
            self._replay_head.data_ptr(),
        )  # fmt: skip

    def set_replay(self, routes: Tensor | None) -> None:
        """Replaces every call's routes by recorded ones (benchmarks: a real model's routing
        on random weights): ``routes`` [steps, layers, k] int32 per-layer expert ids (-1: a
        skipped route), token i of the session (prefill and decode, in order) taking row i %
        steps at each of the first ``layers`` MoE layers (the routes past k skipped; the
        router's weights kept); None: the model's own routes. Between steps (decode steps made
        before read it at their next call)."""
        with self._lock:
            self._drain()
            if routes is not None:
                if routes.dim() != 3 or routes.dtype != torch.int32:
                    raise ValueError("replay routes: int32 [steps, layers, k]")
                if routes.shape[1] > self.num_layers or int(routes.max()) >= self.num_experts:
                    raise ValueError("replay routes: more layers or experts than the model's")
                routes = routes.contiguous()
            self._replay_head.zero_()  # (between steps: the native step reads it)
            self.replay = routes
            if routes is not None:
                steps, layers, k = routes.shape
                self._replay_head[:4] = torch.tensor([routes.data_ptr(), steps, layers, k])

    def _replayed(self, flat_ids: Tensor) -> Tensor:
        """A call's flat ids [T, K] replaced by ``replay``'s (as the native step does)."""
        r = self.replay
        assert r is not None
        valid = flat_ids[flat_ids >= 0]
        layer = int(valid[0]) // self.num_experts if valid.numel() else -1
        steps, layers, k = r.shape
        if not 0 <= layer < layers:
            return flat_ids
        t, kk = flat_ids.shape
        pos = int(self._replay_head[4])
        rows = r[(torch.arange(t) + pos) % steps, layer]  # [t, k]
        out = torch.full((t, kk), -1, dtype=torch.int32)
        out[:, : min(k, kk)] = rows[:, :kk]
        out = torch.where(out >= 0, out + layer * self.num_experts, out)
        if layer == layers - 1:
            self._replay_head[4] += t
        return out.to(torch.int32).contiguous()

    def _drain(self) -> None:
        """The native step's logged calls (``native_tier``), in order: touched in the LRU,
        counted as hits, checked against the predictions."""
        n = int(self._log[0])
        if not n:
            return
        vals = self._log[1 : 1 + n].tolist()
        self._log[0] = 0
        call: list[int] = []
        for v in vals:
            if v != -2:
                call.append(v)
                continue
            fids = sorted({f for f in call if f >= 0})
            single = len(call) == self.tier.top_k
            call = []
            self._account(fids, single)
            _, fills = self.cache.lookup(fids)
            if fills:  # the step ran them on their slots: they were resident
                raise RuntimeError(f"disk tier: logged experts {fills} were not resident")

    def close(self) -> None:
        self._finalizer()

    # -- the tier --------------------------------------------------------------------------------
    def _parts(self, flat_ids: Tensor) -> list[tuple[int, int]]:
        """Token ranges [(a, b)] of a call [T, K] whose distinct experts fit the slots of each
        class: the whole call when it fits (a decode step's, or a cache of more than a layer's
        experts), else as many tokens at a time as fit. Each token computes as it would in the
        whole call (the kernels' rows are per token), so the results are the same."""
        t = flat_ids.shape[0]
        if t <= 1:  # a class holds at least top-k slots, one token's
            return [(0, t)]
        cap = self._capacity
        fids = torch.unique(flat_ids).tolist()
        if len(fids) <= min(cap):
            return [(0, t)]
        per: dict[int, int] = {}
        for f in fids:
            if f >= 0:
                c = self.cache.class_of(f)
                per[c] = per.get(c, 0) + 1
        if all(n <= cap[c] for c, n in per.items()):
            return [(0, t)]
        parts, start = [], 0
        held: dict[int, set[int]] = {}
        for i, row in enumerate(flat_ids.tolist()):
            mine: dict[int, set[int]] = {}
            for f in row:
                if f >= 0:
                    mine.setdefault(self.cache.class_of(f), set()).add(f)
            if any(len(held.get(c, set()) | s) > cap[c] for c, s in mine.items()):
                parts.append((start, i))
                start, held = i, {}
            for c, s in mine.items():
                if len(s) > cap[c]:
                    raise RuntimeError(
                        f"the expert cache class {c} holds {cap[c]} slots; a token routes to "
                        f"{len(s)} of its experts"
                    )
                held.setdefault(c, set()).update(s)
        parts.append((start, t))
        return parts

    def _x_of(self, x: int, t: int) -> Tensor:
        xs = (ctypes.c_float * (t * self.hidden_size)).from_address(x)
        return torch.frombuffer(xs, dtype=torch.float32).view(t, self.hidden_size)

    def _begin(self, flat_ids: Tensor) -> tuple[list[int], list[tuple[int, int, int]]]:
        """A call's distinct experts and the fills its lookup made, their reads started (the
        predictions of the call before checked against them; reads ahead it uses counted)."""
        if flat_ids.numel() <= 64:  # a decode call's few ids: no tensor op
            fids = sorted({f for f in flat_ids.reshape(-1).tolist() if f >= 0})
        else:
            fids = [f for f in torch.unique(flat_ids).tolist() if f >= 0]
        if fids and (fids[-1] >= self.num_flat):
            raise IndexError(f"expert id {fids[-1]} outside [-1, {self.num_flat})")
        self._account(fids, flat_ids.shape[0] == 1)
        _, fills = self.cache.lookup(fids)
        if fills:
            self._submit(fills, ahead=False)
        return fids, fills

    def _account(self, fids: list[int], single: bool) -> None:
        """A call's experts (distinct, sorted) checked against the prediction for its layer;
        reads ahead it uses counted; one token's (``single``) taught to ``history``."""
        if self.history is not None and single and fids:
            e = self.num_experts
            self.history.observe(fids[0] // e, [f % e for f in fids])
        layer, predicted = self._predicted
        if predicted and fids and fids[0] // self.num_experts == layer:  # how right it was
            right = len(predicted.intersection(fids)) / len(predicted)
            self.precision += PRECISION_WEIGHT * (right - self.precision)
            self._predicted = (-1, set())
        for f in fids:
            if f in self._unused:  # read ahead for this call (or an earlier one)
                self._unused.discard(f)
                self.counters["read_ahead_hits"] += 1

    def _abandon(self, fills: list[tuple[int, int, int]]) -> None:
        """A call failed: its fills' reads end (none still writing a slot) and their slots are
        free again."""
        for f, _, _ in fills:
            r = self._reading.pop(f, None)
            if r is not None:
                wait([r[1]])
            self.cache.forget(f)

    def _remap(self, flat_ids: Tensor) -> tuple[Tensor, list[int]]:
        """Flat ids [T, K] -> (slot ids, the call's distinct experts), the call's experts all
        read (missing ones now, ones read ahead awaited)."""
        fids, fills = self._begin(flat_ids)
        started = time.perf_counter()
        try:
            for f in fids:
                if f in self._reading:
                    self._collect(f, evicted=False)
        except BaseException:
            self._abandon(fills)
            raise
        self.read_seconds += time.perf_counter() - started
        return self._lut[flat_ids.long() + 1], fids

    def _overlapped(
        self, x: int, flat_ids: Tensor, w: int, out: int, k: int, xt: Tensor | None
    ) -> None:
        """One token's call (flat ids [1, k]) with its experts' reads overlapped with its compute:
        the experts resident at the start, then the missing ones as their reads land (the reads
        run all at once, in route order). The kernel adds a token's route terms up in flat-id
        order from zero (``order``), so the leading routes that are resident make one row of a
        call (their partial sum) and every other route a row of its own (its term: zero plus
        it), the token's x, gate weights and order repeated in each row (a row's results do not
        depend on the call's other rows): one kernel call runs all the routes ready at the start,
        one more each batch of reads that landed meanwhile, and the terms are added to the
        partial sum in that order: the same additions in the same order as one call over all of
        them, bit for bit."""
        fids, fills = self._begin(flat_ids)
        waiting = [f for f in fids if f in self._reading]
        if waiting and not self.overlap:
            started = time.perf_counter()
            try:
                for f in waiting:
                    self._collect(f, evicted=False)
            except BaseException:
                self._abandon(fills)
                raise
            self.read_seconds += time.perf_counter() - started
            waiting = []
        if not waiting:  # all resident: one call
            self._ahead(fids, xt if xt is not None else functools.partial(self._x_of, x, 1))
            slot_ids = self._lut[flat_ids.long() + 1]
            self.inner.forward_addresses(x, slot_ids.data_ptr(), w, out, 1, k, flat_ids.data_ptr())
            return
        xt = xt if xt is not None else self._x_of(x, 1)
        row = flat_ids[0].tolist()
        routes = sorted((f, j) for j, f in enumerate(row) if f >= 0)  # the kernel's order
        landed: SimpleQueue[int] = SimpleQueue()
        for f in waiting:
            self._reading[f][1].add_done_callback(functools.partial(_landed, landed, f))
        ready = set(fids).difference(waiting)
        lead = 0
        while lead < len(routes) and routes[lead][0] in ready:
            lead += 1
        wt = torch.frombuffer((ctypes.c_float * k).from_address(w), dtype=torch.float32)
        self._rows_buf = row_buffers(self._rows_buf, k, self.hidden_size)
        rows = Rows(self._rows_buf, xt, wt, flat_ids, self.cache.slot_of, row)
        rows.run(([[j for _, j in routes[:lead]]] if lead else [])
                 + [[j] for f, j in routes[lead:] if f in ready], self.inner)  # fmt: skip
        left = len(waiting)
        try:
            while left:
                started = time.perf_counter()
                now = {landed.get()}
                while True:  # every read landed meanwhile
                    try:
                        now.add(landed.get_nowait())
                    except Empty:
                        break
                self.read_seconds += time.perf_counter() - started
                for f in sorted(now):
                    self._collect(f, evicted=False)
                left -= len(now)
                if not left:  # the next layer's reads start behind this call's
                    self._ahead(fids, xt)
                rows.run([[j] for f, j in routes[lead:] if f in now], self.inner)
        except BaseException:
            self._abandon(fills)
            raise
        acc = torch.frombuffer((ctypes.c_float * self.hidden_size).from_address(out),
                               dtype=torch.float32)  # fmt: skip
        if lead:
            acc.copy_(rows.of(routes[0][1]))
        else:
            acc.zero_()
        for _, j in routes[lead:]:
            acc.add_(rows.of(j))

    def _ahead(self, fids: list[int], x: Tensor | Callable[[], Tensor]) -> None:
        """Starts reading the next MoE layer's predicted experts (see the class); ``x``: the
        call's input, or how to have it (made only for a prediction: one call in
        ``CHECK_EVERY`` while they are not precise)."""
        if (self.predict is None and self.history is None) or not self.read_ahead or not fids:
            return
        nxt = fids[0] // self.num_experts + 1
        if nxt >= self.num_layers:
            return
        if self.precision < READ_AHEAD_MIN_PRECISION:  # predicted on a call in CHECK_EVERY
            self._doubted += 1
            if self._doubted % CHECK_EVERY:
                self.counters["read_ahead_skipped"] += 1
                return
        e = self.num_experts
        if self.history is not None:
            named = self.history.predict(nxt, [f % e for f in fids if f // e == nxt - 1])
        else:
            assert self.predict is not None
            pred = self.predict(nxt, x if isinstance(x, Tensor) else x())
            if pred is None:
                return
            named = torch.unique(pred).tolist()
        want = [nxt * e + i for i in named if i >= 0]
        if not want:
            return
        self._predicted = (nxt, set(want))
        if self.precision < READ_AHEAD_MIN_PRECISION:  # predicted (and checked), not read
            self.counters["read_ahead_skipped"] += 1
            return
        fills = self.cache.reserve(want, keep=set(fids))
        if fills:
            self.counters["read_ahead"] += len(fills)
            self._submit(fills, ahead=True)

    def read_known(self, flat_ids: Tensor, keep: set[int]) -> None:
        """Experts a later call of this step uses for certain (DeepSeek-V4's hash-routed layers
        know theirs from the token ids: ``MoEBackend.known_routes``): their reads start now and
        run while the layers before that call compute, as reads ahead do (counted the same), with
        no prediction to check. Never evicts ``keep`` (what earlier such calls of the step asked
        for), which this call's experts join."""
        if not self.read_ahead:
            return
        with self._lock:
            self._drain()
            want = [f for f in torch.unique(flat_ids).tolist() if f >= 0]
            fills = self.cache.reserve(want, keep=keep)
            keep.update(want)
            if fills:
                self.counters["read_ahead"] += len(fills)
                self._submit(fills, ahead=True)

    def _evict(self, fills: list[tuple[int, int, int]]) -> None:
        """The evicted experts of ``fills``: out of the table, their reads finished first (a
        slot being read into is not overwritten), those read ahead unused counted wasted."""
        for _, _, old in fills:
            if old < 0:
                continue
            self._lut[old + 1] = -1
            if old in self._reading:
                self._collect(old, evicted=True)
            if old in self._unused:
                self._unused.discard(old)
                self.counters["read_ahead_wasted"] += 1

    def _submit(self, fills: list[tuple[int, int, int]], ahead: bool) -> None:
        """Evicts, then starts the reads of ``fills`` in flat-id order (the order a call adds
        its experts up in), each expert's pieces all at once on the pool."""
        if self.before_write is not None:
            self.before_write([s for _, s, _ in fills])
        self._evict(fills)
        for f, s, _ in sorted(fills):
            self._reading[f] = (s, self._readers.start(f, s))
            if ahead:
                self._unused.add(f)

    def _collect(self, fid: int, evicted: bool) -> None:
        """Waits for ``fid``'s read; its slot then enters the table unless ``evicted``. A
        failed read: an evicted expert is dropped; a needed one is read again now (and its
        failure then raised, the expert dropped from the cache)."""
        slot, fut = self._reading.pop(fid)
        try:
            nbytes = fut.result()
        except Exception:
            if evicted:
                return
            log.warning("disk tier: reading expert %d failed; reading it again", fid)
            try:
                nbytes = self._readers.read_now(fid, slot)
            except BaseException:
                self.cache.forget(fid)
                raise
        self.counters["fills"] += 1
        self.counters["bytes_read"] += nbytes
        if evicted:
            return
        slots = self.slots
        for b, s in ((self.pool.gate_up_bias, slots.gate_up_bias),
                     (self.pool.down_bias, slots.down_bias)):  # fmt: skip
            if b is not None and s is not None:
                s[slot].copy_(b[fid])
        self._lut[fid + 1] = slot


def _landed(queue: SimpleQueue[int], fid: int, _: Future[int]) -> None:
    queue.put(fid)
