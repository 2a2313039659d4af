"""The disk tier (experts/disk_tier.py, issue 45): routed experts left in the GGUF file, read on
demand into a RAM cache of expert slots under the cpu backend.

Oracle: the same model with its whole expert pool resident. The tier hands the same GGUF rows
(interleaved the same way) to the same kernel in the same route order, only at slot ids, so the
logits are equal bit for bit and greedy tokens equal, for a cache that holds one layer's experts
of three (every layer call misses), single and batched, on the native decode step's path and the
generic one, with and without read-ahead (the next layer's predicted experts read while a layer
computes). The reads (O_DIRECT pieces, page-cache scatter reads) are checked against the file's
bytes.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf
from test_gguf_experts import _prompt, _tiny
from test_gguf_experts_per_layer import _write
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.experts.block_executor import available
from freetokend.experts.disk_cache import RamCache, slot_banks
from freetokend.experts.disk_predict import CooccurrencePredictor
from freetokend.experts.disk_reads import _tier_read
from freetokend.experts.disk_tier import READ_AHEAD_MIN_PRECISION, SWITCH_S, TieredExecutor
from freetokend.experts.formats import allocate, expert_rows, layered_format
from freetokend.formats import direct_read
from freetokend.formats.errors import CheckpointError
from freetokend.models.layers import cpu_decode
from freetokend.native import dense_native

LOAD = dict(max_model_len=128, kv_tokens=1024, prefix_cache=False)
TINY_CACHE_MB = 0.01  # below one expert: the tier keeps top-k (2 of 24), a quarter of a layer


# ---- the policy ---------------------------------------------------------------------------------


def test_ram_cache_is_an_lru_that_never_evicts_its_own_call() -> None:
    c = RamCache([[0, 1, 2]], lambda f: 0)
    slots, fills = c.lookup([10, 11, 12])
    assert fills == [(10, 0, -1), (11, 1, -1), (12, 2, -1)] and slots == {10: 0, 11: 1, 12: 2}
    slots, fills = c.lookup([11])  # a hit: 11 is now the most recent
    assert fills == [] and (c.hits, c.misses) == (1, 3)
    slots, fills = c.lookup([13, 10])  # 10 hits first; the victim is 12, the least recent
    assert fills == [(13, 2, 12)] and slots == {10: 0, 13: 2}
    assert 12 not in c.slot_of and c.slot_of[13] == 2
    c.forget(13)  # a failed read: its slot is the next victim
    _, fills = c.lookup([14])
    assert fills == [(14, 2, -1)]
    with pytest.raises(RuntimeError, match="fewer slots than one call needs"):
        c.lookup([20, 21, 22, 23])
    # classes: each expert only in its class's slots
    c = RamCache([[0, 1], [2, 3]], lambda f: f // 100)
    _, fills = c.lookup([5, 105, 6])
    assert fills == [(5, 0, -1), (105, 2, -1), (6, 1, -1)]
    _, fills = c.lookup([7, 106])
    assert fills == [(7, 0, 5), (106, 3, -1)]


def test_ram_cache_too_small_for_a_token_inserts_bimodally() -> None:
    """A class of 2 slots where a token uses 3 experts (one per layer, three layers): an LRU
    evicts each expert before the next token needs it again (no hits); the bimodal insertion
    puts fills back at the least recent end, so what is resident stays and hits."""
    seq = [[10], [20], [30]] * 8  # one token's three layer calls, eight tokens
    lru = RamCache([[0, 1]], lambda f: 0)
    bip = RamCache([[0, 1]], lambda f: 0, per_token=[3])
    for call in seq:
        lru.lookup(call)
        bip.lookup(call)
    assert lru.hits == 0 and not lru.bimodal[0]
    assert bip.bimodal[0] and bip.hits >= 7  # expert 10 stays from the first token on
    assert bip.hits + bip.misses == len(seq)
    # a class that holds a token's experts keeps the LRU
    assert not RamCache([[0, 1, 2]], lambda f: 0, per_token=[3]).bimodal[0]


def test_ram_cache_reserve_never_evicts_the_running_call_nor_counts() -> None:
    c = RamCache([[0, 1, 2, 3]], lambda f: 0)
    c.lookup([10, 11])
    c.lookup([12])  # LRU order: 3 (free), 10, 11, 12
    # 11 is resident (touched); 20 takes the free slot; 21 evicts 10, the least recent
    assert c.reserve([11, 20, 21], keep={12}) == [(20, 3, -1), (21, 0, 10)]
    assert (c.hits, c.misses) == (0, 3) and 10 not in c.slot_of
    # LRU order now: 12, 11, 20, 21; 12 runs and the rest is wanted: nothing is evicted
    assert c.reserve([11, 20, 21, 22], keep={12}) == []
    assert c.reserve([22], keep=set()) == [(22, 2, 12)]  # 12 no longer runs
    slots, fills = c.lookup([21, 22])  # read ahead, then used: hits
    assert fills == [] and slots == {21: 0, 22: 2} and c.hits == 2


def test_cooccurrence_predictor_names_what_followed_the_layer_before() -> None:
    """The read-ahead learned from the routes alone (disk_predict): layer L + 1's experts that
    followed this token's layer-L ones, the most often first, none never seen; a layer observed
    after one that is not the layer before (a new token's first) is not counted."""
    p = CooccurrencePredictor(num_layers=3, num_experts=8, width=2)
    for _ in range(3):
        p.observe(0, [1, 2])
        p.observe(1, [5, 6])
        p.observe(2, [7])
    p.observe(0, [3])
    p.observe(1, [4])
    p.observe(1, [0])  # not after layer 0: counts nothing
    assert sorted(p.predict(1, [1])) == [5, 6]
    assert p.predict(1, [3]) == [4]
    assert p.predict(2, [5, 6]) == [7]
    assert p.predict(1, [0]) == []  # nothing ever followed expert 0 of layer 0
    assert p.predict(2, [4]) == []  # layer 2 never came after [4] nor after [0]
    assert p.predict(0, [1]) == [] and p.predict(3, [1]) == []  # no layer before / past the end
    p.observe(0, [3])
    p.observe(1, [4])
    p.observe(0, [3])
    p.observe(1, [2])
    assert p.predict(1, [3]) == [4, 2]  # twice before once
    with pytest.raises(ValueError, match="width"):
        CooccurrencePredictor(3, 8, 0)


def test_slot_banks_per_layer_classes_follow_the_pool_share() -> None:
    e, h, i = 4, 256, 256
    pairs = [("q4_k", "q6_k"), ("q4_k", "q4_k"), ("q4_k", "q6_k"), ("q4_k", "q6_k")]
    with torch.device("meta"):
        pool = allocate(layered_format(pairs), 4 * e, h, i, torch.bfloat16)
    # the minimum: top-k (2) slots per class, half a layer's experts
    banks, classes, layer_class = slot_banks(pool, e, cache_bytes=1, group=2)
    assert layer_class == [0, 1, 0, 0] and banks.format == "layers:q4_k/q6_k,q4_k"
    assert classes == [[0, 1], [2, 3]] and banks.num_flat == 4
    per = pool.nbytes_per_expert()
    banks, classes, _ = slot_banks(pool, e, cache_bytes=3 * e * per, group=e)  # 3 layers' worth
    assert banks.format == "layers:q4_k/q6_k*2,q4_k" and [len(c) for c in classes] == [8, 4]
    # 3 layers' worth in groups of 2: the classes grow by 2 experts, not a layer's 4
    banks, classes, _ = slot_banks(pool, e, cache_bytes=3 * e * per, group=2)
    assert [len(c) for c in classes] == [8, 4] and banks.format == "layers:q4_k/q6_k*4,q4_k*2"
    banks, classes, _ = slot_banks(pool, e, cache_bytes=7 * per, group=2)
    assert [len(c) for c in classes] == [4, 2]  # 7 experts' worth: 3 of the 4 layers are q6_k
    banks, classes, _ = slot_banks(
        pool, e, cache_bytes=1 << 40, group=2
    )  # never more than the pool
    assert banks.num_flat == 4 * e
    with torch.device("meta"):
        plain = allocate("q8_0", 12, h, i, torch.bfloat16)
    banks, classes, layer_class = slot_banks(plain, e, 5 * plain.nbytes_per_expert(), group=2)
    assert banks.num_flat == 5 and classes == [[0, 1, 2, 3, 4]] and layer_class == [0, 0, 0]
    banks, classes, _ = slot_banks(plain, e, 1, group=2)
    assert banks.num_flat == 2
    with pytest.raises(ValueError, match="group"):
        slot_banks(plain, e, 1, group=0)


# ---- the reads ----------------------------------------------------------------------------------


def test_staged_reads_equal_the_files_bytes(tmp_path: Path) -> None:
    """Staged reads (formats/direct_read.py), O_DIRECT and plain, at unaligned offsets, up to the
    file's unaligned end, give the file's bytes; past it, EOFError; more than a piece: refused."""
    data = torch.randint(0, 256, (3 * direct_read.BOUNCE + 12345,), dtype=torch.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    fd = direct_read.open_direct(path)
    if fd is None:
        pytest.skip(f"{tmp_path}: the file system refuses O_DIRECT")
    plain = os.open(path, os.O_RDONLY)
    try:
        for offset, n in ((0, 4096), (33, 5107), (4095, direct_read.PIECE),
                          (data.numel() - 9000, 9000), (77, 0)):  # fmt: skip
            for f, direct in ((fd, True), (plain, False)):
                got = direct_read.read_staged(f, offset, n, direct, str(path))
                assert torch.equal(got, data[offset : offset + n])
        with pytest.raises(EOFError, match="ends"):
            direct_read.read_staged(fd, data.numel() - 10, 11, True)
        with pytest.raises(ValueError, match="at most"):
            direct_read.read_staged(fd, 0, direct_read.PIECE + 1, True)
        read = _tier_read()  # the native read-and-move's copy (disk_reads.SlotMove.native)
        if read is not None:
            out = torch.zeros(direct_read.PIECE, dtype=torch.uint8)
            for offset, n in ((0, 4096), (33, 5107), (4095, direct_read.PIECE),
                              (data.numel() - 9000, 9000), (77, 0)):  # fmt: skip
                for f, direct in ((fd, True), (plain, False)):
                    out.zero_()
                    assert read(f, offset, n, direct, out.data_ptr(), -1, 0, 0, "f") == n
                    assert torch.equal(out[:n], data[offset : offset + n])
            with pytest.raises(EOFError, match="ends"):
                read(fd, data.numel() - 10, 11, True, out.data_ptr(), -1, 0, 0, "f")
            with pytest.raises(ValueError, match="fit"):
                read(fd, 0, direct_read.PIECE + 1, True, out.data_ptr(), -1, 0, 0, "f")
            with pytest.raises(OSError):
                read(-1, 0, 10, False, out.data_ptr(), -1, 0, 0, "f")
    finally:
        os.close(fd)
        os.close(plain)


# ---- the engine ---------------------------------------------------------------------------------


needs_native = pytest.mark.skipif(not available(), reason="ftdense not built")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return _tiny(tmp_path_factory.mktemp("disk_tier"))  # 3 MoE layers of 8 experts, top-2


@pytest.fixture(scope="module")
def kmix(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    _, hf = tiny
    return write_gguf("qwen3_moe", hf, tmp_path_factory.mktemp("kmix") / "m.gguf", "kmix")


def _pair(path: Path, read_ahead: bool = False, experts: int = 0) -> tuple[LLM, LLM]:
    """The resident model and the tiered one, its cache ``experts`` experts' worth (0: the
    smallest)."""
    resident = LLM(path, "cpu", **LOAD)
    mb = experts * resident.banks.nbytes_per_expert() / 2**20 if experts else TINY_CACHE_MB
    tiered = LLM(path, "cpu", expert_cache_mb=mb, expert_read_ahead=read_ahead, **LOAD)
    return resident, tiered


def _generate_on_both_paths(
    tiered: LLM, resident: LLM | None, ids: list[int], after: Any = None
) -> None:
    """Single and batched greedy generations on the native decode step (experts called back)
    and the generic path, equal to ``resident``'s (None: only run); ``after(fast)`` after each."""
    batch = [_prompt(9, seed=s) for s in range(4)]
    for fast in (True, False):
        old = cpu_decode.set_enabled(fast)
        try:
            got = tiered.generate(ids, 12, ignore_eos=True)
            got_batch = tiered.generate(batch, 8, ignore_eos=True)
            if resident is not None:
                assert got == resident.generate(ids, 12, ignore_eos=True)
                assert got_batch == resident.generate(batch, 8, ignore_eos=True)
        finally:
            cpu_decode.set_enabled(old)
        if after is not None:
            after(fast)


def _check_equal(resident: LLM, tiered: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = tiered.moe.tier
    assert isinstance(tier, TieredExecutor) and tiered.moe.executor is tier
    src = tier.tier.source
    if any(fd is not None for fd in src.direct.values()):  # O_DIRECT reads the same bytes
        plain = type(src)(src.files, {}, [], 8, direct=False)
        plain.layers = src.layers
        like = {p: expert_rows(tier.slots, p, 0, 1)[0] for p in ("gate_up", "down")}
        got = []

        def copy(proj: str, a: torch.Tensor, b: torch.Tensor) -> None:
            b.copy_(a)

        for reader in (src, plain):  # expert 9 (layer 1's second), piece by piece
            dest = {p: torch.zeros_like(t) for p, t in like.items()}
            pieces = reader.pieces(9, dest, copy)
            assert len(pieces) == 3  # gate, up, down: each fits a piece
            assert sum(p() for p in pieces) == tier.slots.nbytes_per_expert()
            got.append(dest)
        assert all(torch.equal(got[0][p], got[1][p]) for p in like)
    if tier.slots.interleaved and _tier_read() is not None:  # one native call a piece
        dest, move = tier._readers.slot_io(0)
        ways = []
        for put in (move, lambda *a: move(*a)):  # native, then Python's read and move
            out = {p: torch.zeros_like(t) for p, t in dest.items()}
            pieces = src.pieces(9, out, put)
            assert all(type(p.func) is not type(_check_equal) for p in pieces) == (put is move)
            assert sum(p() for p in pieces) == tier.slots.nbytes_per_expert()
            ways.append(out)
        assert all(torch.equal(ways[0][p], ways[1][p]) for p in dest)
        assert any(move.qtypes.values())  # (interleaved: kmix's types interleave)
        assert all(bool(t.any()) for t in got[0].values())
    assert tier.cache.slots == 2 < tiered.banks.num_flat == 24  # top-k: a quarter of a layer
    # the slots are in the resident pool's interleaved layout, each interleaved as it is read
    # (formats.interleaved_layout: none regrouped at load, the cache's pages untouched)
    assert tier.slots.interleaved and resident.banks.interleaved
    ids = _prompt(24, seed=4)
    parts = TieredExecutor._parts
    split: list[int] = []

    def counted_parts(self, flat_ids):  # type: ignore[no-untyped-def]
        split.append(len(out := parts(self, flat_ids)))
        return out

    monkeypatch.setattr(TieredExecutor, "_parts", counted_parts)
    assert torch.equal(tiered.logits(ids), resident.logits(ids))
    assert min(split) > 1  # the prefill's layer calls ran a few tokens at a time
    before = tier.stats()
    # every layer call read its experts (the cache held another layer's), a few tokens at a time
    # (a part's experts fit two slots): misses > the distinct experts of the three calls
    assert before["misses"] > 24 and before["bytes_read"] > 0
    called = []
    inner = TieredExecutor.forward_addresses

    def counted(self, *a):  # type: ignore[no-untyped-def]
        called.append(a[-2])
        return inner(self, *a)

    monkeypatch.setattr(TieredExecutor, "forward_addresses", counted)

    def native_called_back(fast: bool) -> None:  # the native step called the tier back
        if fast:
            assert called and max(called) == 4  # with each step's routes

    _generate_on_both_paths(tiered, resident, ids, native_called_back)
    st = tier.stats()
    assert st["misses"] > before["misses"] and st["fills"] == st["misses"]
    assert st["hits"] > 0  # a part reuses what the part before it read
    per = tiered.banks.nbytes_per_expert()
    assert st["bytes_read"] == st["fills"] * per
    # the slots take the cache's RAM; the pool's weight banks none
    assert all(t.is_meta for t in tiered.banks.tensors().values())
    assert sum(t.nbytes for t in tier.slots.all_tensors().values()) == 2 * per


@needs_native
def test_disk_tier_equals_the_resident_pool_kmix(kmix: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Equal tokens; and the dense pool's workers spin briefly under the tier (its reader
    threads and its Python share the cores between the pool's jobs), long under the resident
    pool (dense_native.SPIN_US_*), each backend setting its own at every step; the interpreter's
    thread switch likewise (disk_tier.SWITCH_S)."""
    import ftdense  # (needs_native)

    resident, tiered = _pair(kmix)
    _check_equal(resident, tiered, monkeypatch)
    try:
        default = sys.getswitchinterval()
        for llm, spin in [(tiered, dense_native.SPIN_US_SHARED), (resident, dense_native.SPIN_US_OWN),
                          (tiered, dense_native.SPIN_US_SHARED)]:  # fmt: skip
            llm.moe.begin_step(1)
            assert ftdense.spin_us() == spin
            # the interpreter's thread switch: short under the tier (its readers want the GIL)
            assert sys.getswitchinterval() == pytest.approx(SWITCH_S if llm is tiered else default)
    finally:
        dense_native.configure()
        resident.moe.begin_step(1)


@needs_native
def test_disk_tier_read_ahead_equals_the_resident_pool(kmix: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Read-ahead on: the next layer's predicted experts are read while a layer computes, into
    slots the running call does not use."""
    resident, tiered = _pair(kmix, read_ahead=True, experts=8)  # one layer's of three
    tier = tiered.moe.tier
    assert tier is not None and tier.read_ahead and tier.predict is not None
    assert tier.cache.slots == 8
    ids = _prompt(24, seed=4)
    assert torch.equal(tiered.logits(ids), resident.logits(ids))
    _generate_on_both_paths(tiered, resident, ids)
    st = tier.stats()
    assert st["read_ahead"] > 0 and st["read_ahead_hits"] > 0
    assert st["read_ahead_hits"] + st["read_ahead_wasted"] <= st["read_ahead"]
    # every fill is a demand miss or a read ahead (those still in flight not yet counted)
    assert st["misses"] <= st["fills"] <= st["misses"] + st["read_ahead"]
    per = tiered.banks.nbytes_per_expert()
    assert st["bytes_read"] == st["fills"] * per
    # the same requests without read-ahead miss more
    _, plain = _pair(kmix, experts=8)
    plain.logits(ids)
    _generate_on_both_paths(plain, None, ids)
    assert plain.moe.tier.stats()["read_ahead"] == 0
    assert st["misses"] < plain.moe.tier.stats()["misses"]


@needs_native
def test_decode_call_overlapping_reads_equals_the_pool_in_any_landing_order(  # type: ignore[no-untyped-def]
    kmix: Path, monkeypatch
) -> None:
    """A decode call (one token) computes its resident experts while the others are read and
    the missing ones as their reads land, one kernel call for what is ready (route terms as rows
    of their own): the output equals the resident pool's call bit for bit whichever read lands
    last (the first expert in the kernel's order held back: the others' terms wait for it),
    with hits before, between and after the misses, and a call of three term rows (past the
    kernel's decode sizes) among them."""
    resident, tiered = _pair(kmix, experts=8)
    tier = tiered.moe.tier
    assert tier is not None and tier.cache.slots == 8
    pool = resident.moe.executor
    src_type = type(tier.tier.source)
    pieces = src_type.pieces
    slow: set[int] = set()

    def delayed(self, fid, dest, put):  # type: ignore[no-untyped-def]
        out = pieces(self, fid, dest, put)
        if fid not in slow:
            return out

        def late(p):  # type: ignore[no-untyped-def]
            time.sleep(0.2)
            return p()

        return [functools.partial(late, p) for p in out]

    monkeypatch.setattr(src_type, "pieces", delayed)
    landed: list[int] = []
    collect = TieredExecutor._collect

    def counted(self, fid, evicted):  # type: ignore[no-untyped-def]
        landed.append(fid)
        return collect(self, fid, evicted)

    monkeypatch.setattr(TieredExecutor, "_collect", counted)
    rows: list[int] = []  # the rows of each kernel call
    inner_call = tier.inner.forward_addresses

    def kernel(*a):  # type: ignore[no-untyped-def]
        rows.append(a[4])
        return inner_call(*a)

    monkeypatch.setattr(tier.inner, "forward_addresses", kernel)
    g = torch.Generator().manual_seed(3)
    h = tier.hidden_size
    # layer 1's experts 8..15; routes out of id order; (resident first, held back)
    cases = [([13, 9, 11, 15], [], {9}), ([10, 12, 14, 8], [12], {8}),
             ([9, 15, 8, 11], [8, 15], {9}), ([14, 8, 13, 10], [8, 10, 13, 14], set()),
             ([12, 8, 14, 10], [10, 12, 14], {8})]  # fmt: skip
    for route, hits, held in cases:
        for f in list(tier.cache.slot_of):  # a cold cache, then the hits read in
            tier.cache.forget(f)
            tier._lut[f + 1] = -1
        if hits:
            tier.forward(torch.zeros(1, h), torch.tensor([hits], dtype=torch.int32),
                         torch.zeros(1, len(hits)))  # fmt: skip
        assert set(tier.cache.slot_of) == set(hits)
        slow.clear()
        slow.update(held)
        landed.clear()
        x = torch.randn(1, h, generator=g)
        ids = torch.tensor([route], dtype=torch.int32)
        w = torch.rand(1, len(route), generator=g)
        rows.clear()
        got = tier.forward(x, ids, w)
        assert torch.equal(got, pool.forward(x, ids, w))
        if len(hits) == 3:  # 8 missing, first: 10, 12 and 14 are three rows of one call
            assert rows[0] == 3
        misses = [f for f in route if f not in hits]
        assert sorted(landed) == sorted(misses)
        if held:
            assert landed[-1] in held  # it landed last, after the others' terms ran
    # the native decode step's callback (raw addresses) takes the same path
    for f in list(tier.cache.slot_of):
        tier.cache.forget(f)
        tier._lut[f + 1] = -1
    slow.update({8})
    x = torch.randn(1, h, generator=g)
    ids = torch.tensor([[11, 8, 14]], dtype=torch.int32)
    w = torch.rand(1, 3, generator=g)
    out = torch.empty(1, h)
    tier.forward_addresses(x.data_ptr(), ids.data_ptr(), w.data_ptr(), out.data_ptr(), 1, 3)
    assert torch.equal(out, pool.forward(x, ids, w))
    # reads of a few groups of 8 rows each (a projection in several pieces, each interleaved
    # on its own), and a call that waits for all its reads: the same
    src = tier.tier.source
    rb = max(expert_rows(tier.slots, p, 0, 1)[0].shape[1] for p in ("gate_up", "down"))
    monkeypatch.setattr(src, "piece_bytes", 8 * rb)
    dest = {p: expert_rows(tier.slots, p, 0, 1)[0].clone() for p in ("gate_up", "down")}
    assert len(pieces(src, 9, dest, lambda *a: None)) > 3
    for overlap in (True, False):
        tier.overlap = overlap
        for f in list(tier.cache.slot_of):
            tier.cache.forget(f)
            tier._lut[f + 1] = -1
        x = torch.randn(1, h, generator=g)
        ids = torch.tensor([[12, 9, 15]], dtype=torch.int32)
        w = torch.rand(1, 3, generator=g)
        assert torch.equal(tier.forward(x, ids, w), pool.forward(x, ids, w))


@needs_native
def test_disk_tier_reads_ahead_only_while_predictions_are_right(kmix: Path) -> None:
    """Predictions that name experts the next call mostly does not use (the ones the next
    router would not pick for this layer's input) drive the precision down and the reads stop; the tokens stay equal."""
    resident, tiered = _pair(kmix, read_ahead=True, experts=8)
    tier = tiered.moe.tier
    assert tier is not None and tier.predict is not None
    right = tier.predict

    def wrong(layer: int, x: torch.Tensor) -> torch.Tensor | None:
        chosen = right(layer, x)
        if chosen is None:
            return None
        unused = [e for e in range(8) if e not in set(chosen.flatten().tolist())]
        return torch.tensor(unused[:2])

    tier.predict = wrong
    ids = _prompt(9, seed=6)
    assert tiered.generate(ids, 16, ignore_eos=True) == resident.generate(ids, 16, ignore_eos=True)
    st = tier.stats()
    assert tier.precision < READ_AHEAD_MIN_PRECISION
    assert st["read_ahead_skipped"] > 0 and st["read_ahead"] > 0  # trusted them at first
    assert st["read_ahead_hits"] <= st["read_ahead"] // 4  # (the layer's input moves on)
    tier.predict = right  # right predictions (as far as the next layer's router goes) are read
    tier.precision = 1.0
    tiered.generate(ids, 8, ignore_eos=True)
    st = tier.stats()
    assert st["read_ahead_hits"] > 0


@needs_native
def test_disk_tier_equals_the_resident_pool_per_layer_types(  # type: ignore[no-untyped-def]
    tiny, tmp_path: Path, monkeypatch
) -> None:
    """llama.cpp's Q4_K_M keeps some layers' ffn_down in Q6_K: the slots keep per-layer types."""
    _, hf = tiny
    types = [(Q.Q4_K, Q.Q6_K), (Q.Q4_K, Q.Q4_K), (Q.Q4_K, Q.Q6_K)]
    path = _write(hf, tmp_path / "m.gguf", types, monkeypatch)
    resident = LLM(path, "cpu", **LOAD)
    assert resident.banks.format == "layers:q4_k/q6_k,q4_k,q4_k/q6_k"
    # the smallest cache: top-k experts per class (two classes: 4 slots)
    tiered = LLM(path, "cpu", expert_cache_mb=TINY_CACHE_MB, expert_read_ahead=True, **LOAD)
    tier = tiered.moe.tier
    assert tier is not None and tier.slots.format == "layers:q4_k/q6_k,q4_k"
    ids = _prompt(24, seed=5)
    assert torch.equal(tiered.logits(ids), resident.logits(ids))
    assert tiered.generate(ids, 12, ignore_eos=True) == resident.generate(ids, 12, ignore_eos=True)
    assert tier.cache.slots == 4 and tier.stats()["misses"] > 24


@needs_native
def test_resident_layers_run_inside_the_native_step(kmix: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A cache of the whole pool: once read, every layer's experts are resident and the native
    decode step runs them on the slots itself (native_tier), with no call back into the tier;
    the tokens stay equal, and the calls it logged, applied at the tier's next call, leave the
    LRU and the counters as the generic path's calls through the tier do."""
    resident, tiered = _pair(kmix, experts=24)
    _, generic = _pair(kmix, experts=24)
    tier, other = tiered.moe.tier, generic.moe.tier
    assert tier is not None and tier.cache.slots == 24 and tier.native_tier() is not None
    assert other is not None
    for llm in (tiered, generic):  # the same state: every expert read
        llm.generate([_prompt(24, seed=4), _prompt(48, seed=5)], 4, ignore_eos=True)
    assert len(tier.cache.slot_of) == 24 and tier.stats() == other.stats()
    ids = _prompt(9, seed=3)
    called: list[int] = []
    inner = TieredExecutor.forward_addresses

    def counted(self, *a):  # type: ignore[no-untyped-def]
        called.append(a[-2])
        return inner(self, *a)

    monkeypatch.setattr(TieredExecutor, "forward_addresses", counted)
    before = tier.stats()
    want = resident.generate(ids, 12, ignore_eos=True)
    assert tiered.generate(ids, 12, ignore_eos=True) == want
    st = tier.stats()
    assert not called  # every decode layer ran inside the native step
    assert st["misses"] == before["misses"] and st["fills"] == before["fills"]
    # 11 decode steps x 3 layers on the native path, the prefill's 3 calls through Python
    assert st["hits"] - before["hits"] >= 11 * 3
    old = cpu_decode.set_enabled(False)
    try:
        assert generic.generate(ids, 12, ignore_eos=True) == want
    finally:
        cpu_decode.set_enabled(old)
    assert other.stats() == st
    assert [list(c.items()) for c in tier.cache.lru] == [list(c.items()) for c in other.cache.lru]
    # a miss goes back to the tier: the smallest cache calls back at every decode layer
    _, small = _pair(kmix)
    assert small.generate(ids, 12, ignore_eos=True) == want
    assert called


@needs_native
def test_replayed_routes_on_both_paths(kmix: Path) -> None:  # type: ignore[no-untyped-def]
    """A replay (set_replay, the benchmark's recorded routing) replaces every call's experts,
    on the native step's fast path, its calls back and the generic path alike: the same
    tokens on each path and at any cache size, only the replayed experts read."""
    routes = torch.tensor([[[1, 5], [2, -1], [7, 0]], [[5, 3], [2, 6], [0, 7]],
                           [[1, 4], [6, 2], [7, 0]]], dtype=torch.int32)  # fmt: skip
    used = {layer * 8 + int(e) for layer in range(3) for e in routes[:, layer].flatten() if e >= 0}
    ids = _prompt(9, seed=3)
    runs = []
    for experts in (0, 24):
        _, tiered = _pair(kmix, experts=experts)
        tier = tiered.moe.tier
        assert tier is not None
        for fast in (True, False):
            tier.set_replay(routes)
            old = cpu_decode.set_enabled(fast)
            try:
                runs.append(tiered.generate(ids, 10, ignore_eos=True))
            finally:
                cpu_decode.set_enabled(old)
        assert set(tier.cache.slot_of) <= used
        if experts:
            assert tier.stats()["fills"] == len(used)
        tier.set_replay(None)
        own = tiered.generate(ids, 10, ignore_eos=True)
    assert all(r == runs[0] for r in runs) and own != runs[0]
    with pytest.raises(ValueError, match="experts"):
        tier.set_replay(torch.full((2, 3, 2), 8, dtype=torch.int32))


@needs_native
def test_disk_tier_sums_routes_in_the_pools_order_at_top_4(tmp_path: Path) -> None:
    """Top-4: a token's four route terms add up in flat-id order whatever slots hold them (the
    kernel sorts routes by the ``order`` the tier passes, not by slot): logits equal bit for bit
    for a cache of top-k slots (calls split by tokens) and one of 12, not a whole layer's (a
    slot order that differs from the experts' changed the last bits before)."""
    _, hf = make_tiny("qwen3_moe", tmp_path / "hf", seed=11, hidden_size=256,
                      moe_intermediate_size=256, head_dim=64, num_attention_heads=4,
                      num_key_value_heads=2, mlp_only_layers=[], num_experts_per_tok=4)  # fmt: skip
    path = write_gguf("qwen3_moe", hf, tmp_path / "m.gguf", "kmix")
    resident = LLM(path, "cpu", **LOAD)
    per = resident.banks.nbytes_per_expert()
    ids = _prompt(24, seed=4)
    want = resident.logits(ids)
    tokens = resident.generate(ids, 8, ignore_eos=True)
    for mb, slots in ((TINY_CACHE_MB, 4), (12 * per / 2**20, 12)):
        tiered = LLM(path, "cpu", expert_cache_mb=mb, **LOAD)
        assert tiered.moe.tier is not None and tiered.moe.tier.cache.slots == slots
        assert torch.equal(tiered.logits(ids), want)
        assert tiered.generate(ids, 8, ignore_eos=True) == tokens


@needs_native
def test_disk_tier_cache_of_0_is_the_memory_left(kmix: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """expert_cache_mb 0: the cache is sized once the dense weights are in, from what
    runtime/memlimit.memory_left measures (the cgroup's limit or 3/4 of RAM, less what the
    process holds), with one sequence's KV and the work reserve set aside."""
    from freetokend.engine import build
    from freetokend.manager.models import expert_cache_mb
    from freetokend.runtime.memlimit import TIER_WORK_RESERVE_BYTES

    per = LLM(kmix, "cpu", expert_cache_mb=TINY_CACHE_MB, **LOAD).banks.nbytes_per_expert()
    asked: list[int] = []

    def left(reserve_bytes: int = 0) -> int:
        asked.append(reserve_bytes)
        return 5 * per  # what the memory cgroup leaves, say

    monkeypatch.setattr(build, "memory_left", left)
    tiered = LLM(kmix, "cpu", expert_cache_mb=0, **LOAD)
    assert tiered.moe.tier is not None and tiered.moe.tier.cache.slots == 5
    assert len(asked) == 1 and asked[0] > TIER_WORK_RESERVE_BYTES  # + one sequence's KV
    # the daemon asks for it when its host budget is the default one (measured)
    assert expert_cache_mb(kmix, 0, "on", 0.0, "cpu", measured=True) == 0.0
    assert expert_cache_mb(kmix, 1 << 40, "on", 0.0, "cpu") > 0  # a budget set: what it leaves


@needs_native
def test_disk_tier_refusals(tiny, kmix: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, hf = tiny
    with pytest.raises(CheckpointError, match="GGUF files only for now"):
        LLM(folder, "cpu", expert_cache_mb=1, **LOAD)
    with pytest.raises(ValueError, match="fused keeps every expert"):  # (offload, hybrid:
        LLM(
            kmix, "fused", accelerator="standin", expert_cache_mb=1, **LOAD
        )  # test_disk_tier_device)
    f32 = write_gguf("qwen3_moe", hf, tmp_path / "f32.gguf", "f32")
    with pytest.raises(CheckpointError, match="block format"):
        LLM(f32, "cpu", expert_cache_mb=1, **LOAD)


def test_ftctl_stats_disk_column() -> None:
    from ftctl.stats import _disk

    assert _disk({"disk_bytes_read": 0}) == "-"
    assert _disk({"disk_bytes_read": 3 << 20, "disk_read_seconds": 0.5}) == "3 MiB, 6 MiB/s"
    ahead = {"disk_read_ahead": 8, "disk_read_ahead_hits": 6, "disk_read_ahead_wasted": 1}
    assert _disk({"disk_bytes_read": 1 << 20, **ahead}) == "1 MiB, ahead 75% used"


@needs_native
def test_manager_counts_the_ram_cache_not_the_file(kmix: Path) -> None:
    from freetokend.manager.models import host_bytes

    resident, tiered = _pair(kmix)
    dense = sum(t.nbytes for t in tiered.model.state_dict().values())
    per = tiered.banks.nbytes_per_expert()
    assert host_bytes(tiered) == dense + 2 * per
    assert host_bytes(resident) == dense + 24 * per
