"""Expert-cache policy replay over recorded MoE routing.

Replay semantics (those behind shared/data/routing-traces/README.md's reference curves): prefill
is one batch per layer holding every prompt token's routes token-major; decode is one batch per
(token, layer) in layer order; inside a batch each distinct expert is one lookup; a miss is
admitted and eviction never removes the batch's own entries; the hit rate is decode-only.

Policies (`run_policies`):
    lru            global LRU over (layer, expert) entries with a byte budget, exactly the
                   reference simulator's accounting (the batch may overshoot the budget, the
                   eviction after it brings the cache back under)
    belady         the same, evicting the entry whose next use is furthest (forced-fill optimum)
    static_hot     KTransformers-style: the experts most often routed during prefill are pinned
                   for the whole decode, the rest are computed on the CPU
    static_layers  llama.cpp-style (--n-cpu-moe): whole layers resident, the last layers first
    ours           the real SlotCache (`decode_step_reference`, every miss filled) with its
                   AGED_FREQ eviction; `lru_slotcache` is the same cache with LRU eviction
    ram_lru        the disk tier's RAM cache (`disk_cache.RamCache`, one class of uniform slots):
                   `replay_ram_cache`
The SlotCache has uniform slots: a byte budget gives `budget // mean expert bytes` slots
(`num_slots_for`); `lru_slotcache` against `lru` measures what that rounding costs.

Trace formats (`read_trace` picks by suffix):
    *.csv    bigmoeonedge route trace: `#` preamble (`# model=... n_layer= n_expert=
             n_expert_used=`, one `# layer=L expert_bytes=B` per layer) then CSV rows
             `turn,phase,step,layer,slot,expert,...`, phase 0 = prefill, 1 = decode
    *.json   granite trace `{num_layers, num_experts, top_k, prompts: {name: {prefill[P][L][K],
             decode[D][L][K]}}}`; prompts are replayed one after another as one session
    *.jsonl  our engine's trace: an optional first line `{"meta": {"num_layers": L,
             "num_experts": E, "expert_bytes": B or [B per layer]}}`, then one line per MoE
             layer call in execution order: `{"phase": "prefill"|"decode", "layer": L,
             "ids": [[e, ...], ...]}` with one row of per-layer expert indices (0..E-1) per
             token of the call (decode: one row per sequence in the batch)
"""

from __future__ import annotations

import csv
import heapq
import json
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from freetokend.experts.disk_cache import RamCache
from freetokend.experts.slot_cache import EvictionPolicy, SlotCache

MIB = 1 << 20
POLICIES = ("ours", "lru", "static_hot", "static_layers", "belady")


@dataclass(frozen=True)
class Batch:
    """One MoE layer call: ids [T][K] per-layer expert indices."""

    layer: int
    ids: tuple[tuple[int, ...], ...]
    decode: bool


@dataclass(frozen=True)
class Trace:
    name: str
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: tuple[int, ...] | None  # per layer; None when the trace does not say
    batches: tuple[Batch, ...]

    def with_expert_bytes(self, nbytes: int) -> Trace:
        """The same trace with every expert `nbytes` large (for traces without sizes)."""
        return replace(self, expert_bytes=(nbytes,) * self.num_layers)

    def sizes(self) -> tuple[int, ...]:
        if self.expert_bytes is None:
            raise ValueError(f"{self.name}: no expert sizes in the trace; give one explicitly")
        return self.expert_bytes


# -- readers ---------------------------------------------------------------------------------
def read_bigmoe_csv(path: str | Path) -> Trace:
    meta: dict[str, str] = {}
    sizes: dict[int, int] = {}
    pre: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    dec: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    with open(path) as f:
        lines = [ln for ln in f if ln.strip()]
    for ln in lines:
        if not ln.startswith("#"):
            continue
        kv = dict(p.split("=", 1) for p in ln[1:].split() if "=" in p)
        if "layer" in kv:
            sizes[int(kv["layer"])] = int(kv["expert_bytes"])
        else:
            meta.update(kv)
    for row in csv.DictReader(ln for ln in lines if not ln.startswith("#")):
        step, layer, rank, e = (int(row[k]) for k in ("step", "layer", "slot", "expert"))
        if row["phase"] == "0":
            pre[layer].append((step, rank, e))
        else:
            dec[(step, layer)].append((rank, e))
    layers = sorted(set(pre) | {lay for _, lay in dec})
    batches = [Batch(lay, _token_rows(sorted(pre[lay])), False) for lay in layers if lay in pre]
    for step in sorted({s for s, _ in dec}):
        for lay in layers:
            if (step, lay) in dec:
                ids = tuple(e for _, e in sorted(dec[(step, lay)]))
                batches.append(Batch(lay, (ids,), True))
    n_layer = int(meta["n_layer"])
    return Trace(
        name=Path(path).name,
        num_layers=n_layer,
        num_experts=int(meta["n_expert"]),
        top_k=int(meta["n_expert_used"]),
        expert_bytes=tuple(sizes[i] for i in range(n_layer)) if len(sizes) == n_layer else None,
        batches=tuple(batches),
    )


def _token_rows(routes: list[tuple[int, int, int]]) -> tuple[tuple[int, ...], ...]:
    """(step, rank, expert) sorted token-major -> one row per token."""
    rows: dict[int, list[int]] = defaultdict(list)
    for step, _, e in routes:
        rows[step].append(e)
    return tuple(tuple(r) for r in rows.values())


def read_granite_json(path: str | Path, prompt: str | None = None) -> Trace:
    d = json.loads(Path(path).read_text())
    batches: list[Batch] = []
    for name, p in d["prompts"].items():
        if prompt is not None and name != prompt:
            continue
        n_layers = len(p["prefill"][0])
        for lay in range(n_layers):  # one prefill batch per layer, all tokens
            batches.append(Batch(lay, tuple(tuple(tok[lay]) for tok in p["prefill"]), False))
        for tok in p["decode"]:
            batches.extend(Batch(lay, (tuple(tok[lay]),), True) for lay in range(n_layers))
    if not batches:
        raise ValueError(f"{path}: no prompt named {prompt!r}")
    return Trace(
        Path(path).name, d["num_layers"], d["num_experts"], d["top_k"], None, tuple(batches)
    )


def read_jsonl(path: str | Path) -> Trace:
    meta: dict = {}
    batches: list[Batch] = []
    with open(path) as f:
        for ln in f:
            if not ln.strip():
                continue
            rec = json.loads(ln)
            if "meta" in rec:
                meta = rec["meta"]
                continue
            ids = tuple(tuple(int(e) for e in row) for row in rec["ids"])
            batches.append(Batch(int(rec["layer"]), ids, rec["phase"] == "decode"))
    n_layers = meta.get("num_layers", 1 + max(b.layer for b in batches))
    n_experts = meta.get("num_experts", 1 + max(e for b in batches for r in b.ids for e in r))
    top_k = max(len(r) for b in batches for r in b.ids)
    eb = meta.get("expert_bytes")
    sizes = None if eb is None else tuple(eb) if isinstance(eb, list) else (int(eb),) * n_layers
    return Trace(Path(path).name, n_layers, n_experts, top_k, sizes, tuple(batches))


def read_trace(path: str | Path) -> Trace:
    suffix = Path(path).suffix
    readers = {".csv": read_bigmoe_csv, ".json": read_granite_json, ".jsonl": read_jsonl}
    if suffix not in readers:
        raise ValueError(f"{path}: unknown trace format (want .csv, .json or .jsonl)")
    return readers[suffix](path)


# -- byte-budget simulators ------------------------------------------------------------------
@dataclass
class HitCount:
    hits: int = 0
    lookups: int = 0

    def add(self, hit: bool) -> None:
        self.hits += hit
        self.lookups += 1

    @property
    def pct(self) -> float:
        return 100.0 * self.hits / self.lookups if self.lookups else 0.0


def _keys(tr: Trace, b: Batch) -> Iterable[int]:
    """Flat ids of a batch, one per route, token-major."""
    return (b.layer * tr.num_experts + e for row in b.ids for e in row)


def simulate_lru(tr: Trace, budget: int) -> HitCount:
    """Global LRU, byte budget; every route promotes, eviction after the batch."""
    sizes, res, used, out = tr.sizes(), OrderedDict[int, int](), 0, HitCount()
    for b in tr.batches:
        touched: set[int] = set()
        for k in _keys(tr, b):
            if k not in touched:
                touched.add(k)
                if b.decode:
                    out.add(k in res)
                if k not in res:
                    res[k] = sizes[b.layer]
                    used += res[k]
            res.move_to_end(k)
        while used > budget and next(iter(res)) not in touched:  # batch entries sit at the end
            used -= res.popitem(last=False)[1]
    return out


def simulate_belady(tr: Trace, budget: int) -> HitCount:
    """Forced-fill Belady: evict the entry used furthest in the future (ties: oldest admitted)."""
    occ: dict[int, list[int]] = defaultdict(list)
    for bi, b in enumerate(tr.batches):
        for k in dict.fromkeys(_keys(tr, b)):
            occ[k].append(bi)
    never = len(tr.batches)
    nxt = {k: 0 for k in occ}  # index into occ[k] of the next use
    sizes, out, used, seq = tr.sizes(), HitCount(), 0, 0
    res: dict[int, tuple[int, int]] = {}  # key -> (bytes, admission seq)
    cur: dict[int, tuple[int, int]] = {}  # key -> its live heap entry (next use, seq)
    heap: list[tuple[int, int, int]] = []  # (-next use, admission seq, key), lazily invalidated
    for b in tr.batches:
        touched = set(_keys(tr, b))
        for k in dict.fromkeys(_keys(tr, b)):
            if b.decode:
                out.add(k in res)
            if k not in res:
                res[k], seq = (sizes[b.layer], seq), seq + 1
                used += sizes[b.layer]
            nxt[k] += 1
            use = occ[k][nxt[k]] if nxt[k] < len(occ[k]) else never
            cur[k] = (use, res[k][1])
            heapq.heappush(heap, (-use, res[k][1], k))
        held = []
        while used > budget and len(res) > len(touched):
            item = heapq.heappop(heap)
            k = item[2]
            if k not in res or cur[k] != (-item[0], item[1]):
                continue  # stale
            if k in touched:
                held.append(item)  # the batch's own entries are never evicted
                continue
            used -= res.pop(k)[0]
        for item in held:
            heapq.heappush(heap, item)
    return out


def simulate_static_hot(tr: Trace, budget: int) -> HitCount:
    """Pin the experts routed most often in prefill (ties: lowest flat id) while they fit."""
    sizes = tr.sizes()
    counts = Counter(k for b in tr.batches if not b.decode for k in _keys(tr, b))
    pinned, used = set(), 0
    for k, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        cost = sizes[k // tr.num_experts]
        if used + cost <= budget:
            pinned.add(k)
            used += cost
    return _count_static(tr, lambda k: k in pinned)


def simulate_static_layers(tr: Trace, budget: int) -> HitCount:
    """Keep whole layers resident, from the last layer down, as long as the next one fits."""
    sizes, resident, used = tr.sizes(), set(), 0
    for lay in reversed(range(tr.num_layers)):
        cost = sizes[lay] * tr.num_experts
        if used + cost > budget:
            break
        resident.add(lay)
        used += cost
    return _count_static(tr, lambda k: k // tr.num_experts in resident)


def _count_static(tr: Trace, resident: Callable[[int], bool]) -> HitCount:
    out = HitCount()
    for b in tr.batches:
        if b.decode:
            for k in dict.fromkeys(_keys(tr, b)):
                out.add(resident(k))
    return out


# -- the real SlotCache ----------------------------------------------------------------------
def num_slots_for(tr: Trace, budget: int) -> int:
    """Uniform slots a byte budget buys: budget // mean expert bytes over the layers."""
    sizes = tr.sizes()
    return int(budget * len(sizes) // sum(sizes))


def replay_slot_cache(tr: Trace, num_slots: int, policy: EvictionPolicy) -> HitCount:
    """Drive SlotCache (offload mode: every miss that fits is filled) with the trace; the
    counters are read at each prefill/decode boundary to keep the hit rate decode-only."""
    cache = SlotCache(tr.num_layers, tr.num_experts, num_slots, policy)
    out, since = HitCount(), None  # since: counters when the current decode run began

    def close(since: dict[str, int]) -> None:
        now = cache.stats()
        out.hits += now["hits"] - since["hits"]
        out.lookups += now["hits"] + now["misses"] - since["hits"] - since["misses"]

    with torch.inference_mode():
        for b in tr.batches:
            if b.decode and since is None:
                since = cache.stats()
            elif not b.decode and since is not None:
                close(since)
                since = None
            width = max(len(r) for r in b.ids)
            rows = [
                [b.layer * tr.num_experts + e for e in r] + [-1] * (width - len(r)) for r in b.ids
            ]
            cache.decode_step(torch.tensor(rows, dtype=torch.int32), b.layer)
    if since is not None:
        close(since)
    return out


def replay_ram_cache(tr: Trace, num_slots: int) -> HitCount:
    """The disk tier's RAM cache policy (an LRU over ``num_slots`` uniform slots; each batch's
    distinct experts one lookup, first-use order; a batch with more than ``num_slots`` runs a
    few tokens at a time, as ``TieredExecutor._parts`` splits it) over the trace; decode-only
    hit rate. Needs ``num_slots`` >= top-k."""
    per_token = [tr.num_layers * tr.top_k]  # fewer slots: bimodal insertion (RamCache)
    cache, out = RamCache([list(range(num_slots))], lambda f: 0, per_token), HitCount()
    for b in tr.batches:
        parts: list[list[int]] = [[]]
        for row in b.ids:  # tokens, as many at a time as the slots hold
            mine = [b.layer * tr.num_experts + e for e in row]
            if len(set(parts[-1]) | set(mine)) > num_slots:
                parts.append([])
            parts[-1] += mine
        for part in parts:
            keys = list(dict.fromkeys(part))
            before = cache.hits
            cache.lookup(keys)
            if b.decode:
                out.hits += cache.hits - before
                out.lookups += len(keys)
    return out


def run_policies(tr: Trace, budget: int, slot_lru: bool = False) -> dict[str, float]:
    """Decode hit % of every policy at one byte budget (keys: POLICIES, + lru_slotcache)."""
    slots = num_slots_for(tr, budget)
    out = {
        "ours": replay_slot_cache(tr, slots, EvictionPolicy.AGED_FREQ).pct,
        "lru": simulate_lru(tr, budget).pct,
        "static_hot": simulate_static_hot(tr, budget).pct,
        "static_layers": simulate_static_layers(tr, budget).pct,
        "belady": simulate_belady(tr, budget).pct,
    }
    if slot_lru:
        out["lru_slotcache"] = replay_slot_cache(tr, slots, EvictionPolicy.LRU).pct
    return out
