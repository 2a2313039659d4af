"""A KV pool whose layers differ in geometry (Gemma-4: global layers have another head dim and
KV head count than sliding ones): per-layer storage that writes, reads, copies pages, resizes,
counts its bytes and spills to disk (and back) with its own shapes."""

from __future__ import annotations

from array import array

import pytest
import torch

from freetokend.kv.pool import KVPool
from freetokend.kv.radix import RadixCache
from freetokend.kv.seq_state import RecurrentState
from freetokend.kv.snapshots import Snapshot, prefix_key
from freetokend.kv.spill import SnapshotSpill, engine_fingerprint
from freetokend.store import Store

SHAPES = [(4, 8), (1, 16), (4, 8), (2, 12)]  # (kv_heads, head_dim) per layer
PAGE = 4


def _kv(n: int, shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randn(n, *shape, generator=g)


def _fill(pool: KVPool, pages: list[int], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer, shape in enumerate(SHAPES):
        k, v = _kv(n, shape, seed=layer)
        pool.write(layer, pages, 0, k, v)
        out.append((k, v))
    return out


def test_each_layer_has_its_own_shape_and_bytes() -> None:
    pool = KVPool(len(SHAPES), 6, PAGE, 0, 0, torch.float32, layer_shapes=SHAPES)
    assert pool.per_layer and pool.layer_shapes == SHAPES
    assert [tuple(t.shape) for t in pool.k] == [(6, PAGE, h, d) for h, d in SHAPES]
    assert pool.nbytes == 2 * 6 * PAGE * sum(h * d for h, d in SHAPES) * 4
    # a uniform pool keeps its one-tensor form and byte count
    uni = KVPool(2, 6, PAGE, 4, 8, torch.float32, layer_shapes=[(4, 8), (4, 8)])
    assert not uni.per_layer and tuple(uni.k.shape) == (2, 6, PAGE, 4, 8)  # type: ignore[union-attr]
    assert uni.nbytes == 2 * 2 * 6 * PAGE * 32 * 4
    with pytest.raises(ValueError, match="layer_shapes"):
        KVPool(3, 6, PAGE, 0, 0, layer_shapes=SHAPES)


def test_write_read_copy_and_resize_keep_every_layer() -> None:
    pool = KVPool(len(SHAPES), 4, PAGE, 0, 0, torch.float32, layer_shapes=SHAPES)
    pages = pool.alloc(3)
    want = _fill(pool, pages, 10)
    for layer, (k, v) in enumerate(want):
        kr, vr = pool.read(layer, pages, 10, start=3)
        assert torch.equal(kr, k[3:]) and torch.equal(vr, v[3:])
    spare = pool.alloc(1)[0]
    pool.copy_page(pages[1], spare, 3)  # rows 4..6 of every layer
    for layer, (k, v) in enumerate(want):
        assert torch.equal(pool.k[layer][spare, :3], k[4:7])
        assert torch.equal(pool.v[layer][spare, :3], v[4:7])
    pool.free([spare])
    pool.resize(9)  # grow: every layer's pages follow
    assert [t.shape[0] for t in pool.k] == [9] * len(SHAPES)
    for layer, (k, v) in enumerate(want):
        kr, vr = pool.read(layer, pages, 10)
        assert torch.equal(kr, k) and torch.equal(vr, v)
    pool.free(pages)
    pool.resize(3)  # shrink to the pages in use
    assert [t.shape[0] for t in pool.v] == [3] * len(SHAPES)
    for layer, (k, _) in enumerate(want):
        assert torch.equal(pool.read(layer, pages, 10)[0], k)


def test_spill_round_trip_with_per_layer_shapes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pool = KVPool(len(SHAPES), 8, PAGE, 0, 0, torch.float32, layer_shapes=SHAPES)
    radix = RadixCache(pool)
    tokens = list(range(20, 31))
    pos = 10
    pages = pool.alloc(pool.pages_for(pos))
    want = _fill(pool, pages, pos)
    radix.insert(tokens[:pos], pages)
    pool.free(pages)
    state = RecurrentState(torch.randn(0, 3, 2), torch.randn(0, 2, 2, 2))
    snap = Snapshot(
        pos, state, "end_of_turn", prefix_key(tokens, pos), prefix=array("q", tokens[:pos])
    )
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    fp = engine_fingerprint(model_dir, "float32", pool, "bf16")
    uniform = KVPool(len(SHAPES), 8, PAGE, 4, 8, torch.float32)
    assert fp != engine_fingerprint(model_dir, "float32", uniform, "bf16")  # layout is covered
    store = Store(tmp_path / "state")
    spill = SnapshotSpill(store, fp, 1 << 30)
    assert spill.spill([snap], pool, radix).files == 1
    # a fresh pool (another engine run) loads it back: every layer's K and V, its own shape
    pool2 = KVPool(len(SHAPES), 8, PAGE, 0, 0, torch.float32, layer_shapes=SHAPES)
    radix2 = RadixCache(pool2)
    spill2 = SnapshotSpill(store, fp, 1 << 30)
    (rec,) = spill2.candidates(tokens, 0)
    got = spill2.load(rec, tokens, pool2, radix2, state)
    assert got is not None
    pages2, matched = radix2.match_prefix(tokens[:pos])
    assert matched == pos
    for layer, (k, v) in enumerate(want):
        kr, vr = pool2.read(layer, pages2, pos)
        assert kr.shape == (pos, *SHAPES[layer])
        assert torch.equal(kr, k) and torch.equal(vr, v)


def test_page_regions_are_counted_copied_and_resized_with_their_pages() -> None:
    """Rows a page holds beside K and V (DeepSeek-V4's compressed entries): fp32, counted in
    the pool's bytes and layout, copied whole with a page on write, kept by a resize."""
    plain = KVPool(1, 4, PAGE, 1, 1, torch.float32)
    pool = KVPool(1, 4, PAGE, 1, 1, torch.float32, regions=[(2, 8), (1, 3)])
    assert [tuple(t.shape) for t in pool.regions] == [(4, 2, 8), (4, 1, 3)]
    assert all(t.dtype == torch.float32 for t in pool.regions)
    assert pool.nbytes == plain.nbytes + 4 * 4 * (2 * 8 + 3)
    assert pool.layout != plain.layout and "region (2, 8)" in pool.layout
    a, b = pool.alloc(2)
    for t in pool.regions:
        t[a] = torch.randn(t.shape[1:])
    pool.copy_page(a, b, 1)  # one token row: the regions' rows all the same
    assert all(torch.equal(t[b], t[a]) for t in pool.regions)
    want = [t[a].clone() for t in pool.regions]
    pool.resize(6)
    assert [tuple(t.shape) for t in pool.regions] == [(6, 2, 8), (6, 1, 3)]
    assert all(torch.equal(t[a], w) for t, w in zip(pool.regions, want, strict=True))
    with pytest.raises(ValueError, match="region"):
        KVPool(1, 4, PAGE, 1, 1, regions=[(0, 8)])
