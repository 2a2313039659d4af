"""Snapshot spill: recurrent-state snapshots and the KV of their prefix on disk, so a restarted
engine resumes an agent session by prefilling only the suffix (ARCHITECTURE §5.4).

A hybrid model resumes at position p only with BOTH the recurrent state after p and the KV of
the full-attention layers for positions [0, p). Snapshots of a model's own state (DeepSeek-V4's
``SeqState.v4``) are not spilled: they stay in memory only. The KV is not recomputable from the snapshot, so
each spilled snapshot carries it (the simple, correct design; its cost is p tokens of KV):

  state_dir/snapshots/<fingerprint>/<prefix hash>.safetensors
    conv [linear layers, conv_dim, kernel - 1], ssm [linear layers, v_heads, k_dim, v_dim]
    k, v [attention layers, p, kv_heads, head_dim]
    (a pool whose layers differ in geometry: k.<i>, v.<i> [p, kv_heads_i, head_dim_i] per layer)

with one row per file in the store's ``anchors`` table (fingerprint, prefix hash, position, kind,
bytes, last use, path). The fingerprint covers the weights, the dtype and the KV layout: a file
is only ever loaded into the engine that could have written it. Files are written under a
temporary name and renamed, and carry their position and kind in the header; the table row is
written after the rename, so a file a crash left without its row is adopted at the next start
(and a leftover temporary file deleted). A missing or unreadable file is dropped from the table,
never fatal.

Durability and integrity: the temporary file is fsynced before the rename and the folder after
it, so a power cut leaves either no file or a whole one. The header carries a BLAKE2b digest of
every tensor (``checksums``: name -> hex); a load checks each tensor's digest, dtype and shape
against this engine before any of it reaches the KV pool or a sequence, so a damaged file
(a flipped bit, a bad tensor past the first) is deleted with a warning and the request simply
prefills, while the rest of the batch never sees it. Folders are 0700 and files 0600 whatever
the umask: they hold the KV of users' prompts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..runtime import heartbeat
from ..store import AnchorRecord, Store, model_fingerprint
from ..store.private import FILE_MODE, private_dir
from .pool import KVPool
from .radix import RadixCache
from .seq_state import RecurrentState
from .snapshots import Snapshot, prefix_key

log = logging.getLogger(__name__)

STALE_TMP_S = 600.0  # a temporary file this old is a crash's leftover, not a write in progress


@dataclass(frozen=True)
class SpillReport:
    files: int
    bytes: int
    seconds: float


class SnapshotSpill:
    """Spilled snapshots of one engine configuration (``fingerprint``) in ``store``."""

    def __init__(self, store: Store, fingerprint: str, budget_bytes: int) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.budget = budget_bytes
        self.root = store.state_dir / "snapshots" / fingerprint
        self.records = {r.prefix_hash: r for r in store.anchors(fingerprint)}
        self.loaded = 0
        self.adopted = self._adopt_orphans()

    # ---- writing -----------------------------------------------------------------------------
    def spill(self, snaps: list[Snapshot], pool: KVPool, radix: RadixCache) -> SpillReport:
        """Writes the snapshots not on disk yet whose prefix KV is still in the tree (in order:
        put the most valuable first), then trims the oldest files beyond the disk budget."""
        t0, files, nbytes = time.perf_counter(), 0, 0
        private_dir(self.root.parent)
        private_dir(self.root)
        for snap in snaps:
            heartbeat.beat()  # one file per snapshot: a long spill is progress, not a hang
            key = snap.key.hex()
            state = snap.state
            if key in self.records or snap.prefix is None or not isinstance(state, RecurrentState):
                continue  # on disk, not kept to spill, or a model's own state (not spilled)
            tokens = snap.prefix.tolist()
            pages, matched = radix.match_prefix(tokens)
            if matched < snap.pos:
                continue  # its KV was evicted: the snapshot alone cannot resume
            try:
                size = self._write(key, snap, state, _gather(pool, pages, snap.pos))
            except OSError as e:  # a full disk or a vanished folder costs the file, not the engine
                log.warning("could not spill snapshot %s: %s", key, e)
                continue
            rec = AnchorRecord(
                self.fingerprint, key, snap.pos, snap.kind, size, time.time(), self._rel(key)
            )
            self.store.put_anchor(rec)
            self.records[key] = rec
            files, nbytes = files + 1, nbytes + size
        self._trim()
        return SpillReport(files, nbytes, time.perf_counter() - t0)

    def _write(
        self, key: str, snap: Snapshot, state: RecurrentState, kv: dict[str, torch.Tensor]
    ) -> int:
        path = self.root / f"{key}.safetensors"
        tmp = path.with_suffix(".tmp")
        raw = {"conv": state.conv, "ssm": state.ssm, **kv}
        # on the host: the digest reads the bytes (save_file would copy them over anyway)
        tensors = {n: t.detach().contiguous().cpu() for n, t in raw.items()}
        checksums = {n: tensor_digest(t) for n, t in tensors.items()}
        meta = {"pos": str(snap.pos), "kind": snap.kind, "checksums": json.dumps(checksums)}
        save_file(tensors, str(tmp), meta)
        _sync_private(tmp)  # on disk before the name points at it
        os.replace(tmp, path)
        _sync_dir(self.root)  # the rename itself survives a power cut
        return path.stat().st_size

    def _adopt_orphans(self) -> int:
        """Files on disk without a table row: a crash between the rename and the row. Adopts
        each whose header reads (position, kind), deletes the unreadable ones and the temporary
        files a crash left (older than ``STALE_TMP_S``). Returns how many it adopted."""
        if not self.root.is_dir():
            return 0
        stale = time.time() - STALE_TMP_S  # younger ones may be another daemon's writes
        for tmp in self.root.glob("*.tmp"):
            try:
                if tmp.stat().st_mtime < stale:
                    tmp.unlink()
            except OSError:
                pass
        adopted = 0
        for path in self.root.glob("*.safetensors"):
            key = path.stem
            if key in self.records:
                continue
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                pos, kind = int(meta["pos"]), str(meta["kind"])
                st = path.stat()
            except Exception as e:  # noqa: BLE001 - a torn or foreign file is removed, never fatal
                log.warning("removing unreadable spill file %s: %s", path.name, e)
                path.unlink(missing_ok=True)
                continue
            rec = AnchorRecord(
                self.fingerprint, key, pos, kind, st.st_size, st.st_mtime, self._rel(key)
            )
            self.store.put_anchor(rec)
            self.records[key] = rec
            adopted += 1
        if adopted:
            log.info("adopted %d spilled snapshot(s) a crash left without a record", adopted)
        return adopted

    def _rel(self, key: str) -> str:
        return str(Path("snapshots") / self.fingerprint / f"{key}.safetensors")

    def _trim(self) -> None:
        """Drops the least recently used files while the total exceeds the budget."""
        total = sum(r.bytes for r in self.records.values())
        for rec in sorted(self.records.values(), key=lambda r: r.last_use):
            if total <= self.budget:
                break
            self._drop(rec)
            total -= rec.bytes

    def _drop(self, rec: AnchorRecord) -> None:
        self.records.pop(rec.prefix_hash, None)
        self.store.delete_anchor(self.fingerprint, rec.prefix_hash)
        if rec.spill_path:
            (self.store.state_dir / rec.spill_path).unlink(missing_ok=True)

    # ---- reading -----------------------------------------------------------------------------
    def candidates(self, tokens: list[int], above: int) -> list[AnchorRecord]:
        """Spilled snapshots on ``tokens``' path deeper than ``above`` (leaving >= 1 token to
        feed), deepest first."""
        recs = [r for r in self.records.values() if above < r.position < len(tokens)]
        recs.sort(key=lambda r: r.position, reverse=True)
        return [r for r in recs if prefix_key(tokens, r.position).hex() == r.prefix_hash]

    def load(
        self,
        rec: AnchorRecord,
        tokens: list[int],
        pool: KVPool,
        radix: RadixCache,
        template: RecurrentState,
    ) -> RecurrentState | None:
        """Puts the file's KV into the tree (under ``tokens[:position]``) and returns its state;
        None when the file is unusable (deleted) or the pool has no room (kept). ``template``
        is a recurrent state of this engine: the shapes and dtypes the file's state must have."""
        try:
            t, meta = _read(self.store.state_dir / (rec.spill_path or ""))
            pos = rec.position
            expected = {
                "conv": (tuple(template.conv.shape), template.conv.dtype),
                "ssm": (tuple(template.ssm.shape), template.ssm.dtype),
                **_kv_expected(pool, pos),
            }
            check_tensors(t, meta, expected)
            n_layers = len(pool.k)
            if pool.per_layer:
                k = [t[f"k.{i}"] for i in range(n_layers)]
                v = [t[f"v.{i}"] for i in range(n_layers)]
            else:
                k, v = list(t["k"]), list(t["v"])
        except Exception as e:  # noqa: BLE001 - any unreadable file is dropped, never fatal
            log.warning("deleting damaged spilled snapshot %s: %s", rec.spill_path, e)
            self._drop(rec)
            return None
        n = pool.pages_for(pos)
        if pool.num_free < n:
            radix.evict(n - pool.num_free)
        if pool.num_free < n:
            return None
        pages = pool.alloc(n)
        for layer in range(n_layers):
            pool.write(layer, pages, 0, k[layer], v[layer])
        radix.insert(tokens[:pos], pages)
        pool.free(pages)  # the tree holds what it took
        self.store.touch_anchor(self.fingerprint, rec.prefix_hash)
        self.loaded += 1
        # where this engine keeps its recurrent state (the accelerator's device, or the host)
        dev = template.conv.device
        return RecurrentState(t["conv"].to(dev), t["ssm"].to(dev))


def tensor_digest(t: torch.Tensor) -> str:
    """BLAKE2b-128 of a tensor's bytes (any dtype, bf16 included; a device tensor is copied
    to the host first)."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.data, digest_size=16).hexdigest()


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}


def check_tensors(
    tensors: dict[str, torch.Tensor],
    meta: dict[str, str],
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> None:
    """Raises ValueError naming the first of a file's ``tensors`` whose presence, shape, dtype
    or digest (``meta["checksums"]``, from its header) is not what ``expected`` says."""
    try:
        digests = json.loads(meta["checksums"])
    except (KeyError, ValueError):
        raise ValueError("the file has no checksums (written by an older freetoken)") from None
    if set(tensors) != set(expected):
        raise ValueError(f"tensors {sorted(tensors)}, expected {sorted(expected)}")
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"{name}: {t.dtype} {tuple(t.shape)} does not fit this engine ({dtype} {shape})"
            )
        if tensor_digest(t) != digests.get(name):
            raise ValueError(f"{name}: checksum mismatch (the file is damaged)")


def _sync_private(path: Path) -> None:
    """Mode 0600 (save_file used the umask) and the file's data on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fchmod(fd, FILE_MODE)
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _gather(pool: KVPool, pages: list[int], pos: int) -> dict[str, torch.Tensor]:
    """K and V of positions [0, pos) over all attention layers, as the file stores them: "k", "v"
    [layers, pos, kv_heads, head_dim], or per layer "k.<i>", "v.<i>" when layers differ."""
    if pool.per_layer:
        ks, vs = pool.gather(pages, pos)
        return {
            **{f"k.{i}": t for i, t in enumerate(ks)},
            **{f"v.{i}": t for i, t in enumerate(vs)},
        }
    assert isinstance(pool.k, torch.Tensor) and isinstance(pool.v, torch.Tensor)
    table = torch.tensor(pages[: pool.pages_for(pos)], dtype=torch.long)
    k = pool.k[:, table].flatten(1, 2)[:, :pos]
    v = pool.v[:, table].flatten(1, 2)[:, :pos]
    return {"k": k, "v": v}


def _kv_expected(pool: KVPool, pos: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The KV tensors a file for position ``pos`` must hold for this pool: name -> (shape, dtype)."""
    if pool.per_layer:
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for i, (h, d) in enumerate(pool.layer_shapes):
            out[f"k.{i}"] = out[f"v.{i}"] = ((pos, h, d), pool.dtype)
        return out
    h, d = pool.layer_shapes[0]
    shape = (len(pool.k), pos, h, d)
    return {"k": (shape, pool.dtype), "v": (shape, pool.dtype)}


def engine_fingerprint(model_dir: Path, dtype: str, pool: KVPool, expert_format: str) -> str:
    """Weights (the store's model fingerprint), dtype, the experts' format (quantized at load or
    not) and KV layout: what a spilled file needs."""

    layout = f"{dtype}|{pool.layout}"
    if expert_format != "bf16":  # (bf16 adds nothing, so existing files keep their folder)
        layout += f"|experts {expert_format}"
    return hashlib.blake2b(
        (model_fingerprint(model_dir) + layout).encode(), digest_size=12
    ).hexdigest()
