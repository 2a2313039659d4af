"""The disk tier's reads (experts/disk_tier.py, issue 45): an expert read from its source into
its RAM cache slot on a pool of reader threads (``SlotReads``).

An expert is a few independent pieces (``ExpertSource.pieces``: one read per projection's rows,
~1 MB each for Qwen3-30B-A3B's geometry), all of them in flight at once; a future per expert is
set once its last piece has landed (``_Landing``). Each piece goes from the read's bounce buffer
straight into its slot in the cpu backend's row interleave (``SlotMove``, as
``formats.interleave_banks`` leaves a resident pool: one pass over the bytes). The reads and the
moves release the GIL; with the extension built a piece is one call (``ftdense.tier_read``, the
GIL taken once, on return) in place of formats/direct_read.read_staged and the interleave in
Python (~5 GIL takes a piece). bench_disk_tier, 2026-12-07 ~11:30-12:05 UTC, 2-core EPYC Zen 3
shared (load 4-8), before (Python pieces) and after interleaved in one run, medians of 2, two
runs (disk 870 and 418 MB/s): 50 % 26.6 -> 24.3 and 17.9 -> 19.4 tok/s, 25 % 16.5 -> 19.3 and
13.3 -> 15.1: within the runs' spread (one engine's two runs differ by up to 40 %); the read
wait is the disk's latency a layer at a time (random routers: nothing read ahead), not the
reads' Python."""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from ..formats import gguf_interleave
from ..formats.gguf_blocks import BLOCK_BYTES, BLOCK_INPUTS, QTYPE_CODES
from .banks import ExpertBanks
from .formats import expert_rows, interleaves, layer_pair

Tensor = torch.Tensor
READ_THREADS = 8  # reads in flight at once (a disk wants several: 8 measured faster than 4)


class ExpertSource(Protocol):
    """Where experts not resident are read from (a checkpoint file)."""

    def pieces(self, fid: int, dest: dict[str, Tensor], put: SlotMove) -> list[Callable[[], int]]:
        """Expert ``fid``'s weights as reads that may run at once (each returns its bytes): each
        reads a piece of one projection's rows (gate, up or down: GGUF rows as the loader reads
        them) and hands it to ``put(proj, src, dest)``, ``dest`` its rows of ``dest`` (bank name
        -> that expert's row of the slot banks; gate rows then up rows in ``gate_up``); a source
        may instead make the read and ``put``'s move in one native call (``SlotMove.qtypes``)."""
        ...

    def close(self) -> None: ...


class SlotMove:
    """How a piece read for a slot goes into it (``put``): interleaved as
    formats.interleave_banks does to a resident pool (``qtypes[proj]``: the GGUF type its rows
    interleave by), else copied (None).

    ``native`` says how ``ftdense.tier_read`` makes a piece's read and move in one call, the GIL
    released throughout (a source's reader thread then runs no Python per piece but the call);
    None where it cannot (the extension not built, too few rows to interleave): the read then
    hands the piece to this object in Python."""

    def __init__(self, qtypes: dict[str, str | None]) -> None:
        self.qtypes = qtypes

    def native(self, proj: str, rows: int, row_bytes: int) -> tuple[Any, int, int] | None:
        """(ftdense.tier_read, its ``qtype``: the code to interleave by or -1 to copy, its
        ``K``: the inputs of a row) for a piece of ``rows`` rows of ``proj``, or None."""
        read = _tier_read()
        if read is None:
            return None
        qtype = self.qtypes[proj]
        if qtype is None:
            return read, -1, 0
        if not gguf_interleave.interleavable(qtype, rows) or row_bytes % BLOCK_BYTES[qtype]:
            return None
        return read, QTYPE_CODES[qtype], row_bytes // BLOCK_BYTES[qtype] * BLOCK_INPUTS[qtype]

    def __call__(self, proj: str, src: Tensor, dest: Tensor) -> None:
        """A piece of a projection's rows (``src``, GGUF rows as the file has them) into
        ``dest``."""
        qtype = self.qtypes[proj]
        if qtype is None:
            ctypes.memmove(dest.data_ptr(), src.data_ptr(), src.numel())
        elif gguf_interleave.native_moves_available():
            gguf_interleave.interleave_to(src, dest, qtype)
        else:
            dest.copy_(gguf_interleave.interleave(src, qtype))


class Readers(Protocol):
    """How experts reach their slots: ``SlotReads`` (the slots in the file's format) or
    device_tier.DequantReads (float slots)."""

    def start(self, fid: int, slot: int) -> Future[int]: ...

    def read_now(self, fid: int, slot: int) -> int: ...

    def close(self) -> None: ...


class SlotReads:
    """Experts read from ``source`` into the slots of ``slots`` on ``threads`` reader threads."""

    def __init__(self, source: ExpertSource, slots: ExpertBanks, threads: int = READ_THREADS):
        self.source, self.slots = source, slots
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="ft-disk-tier")
        self._io: dict[int, tuple[dict[str, Tensor], SlotMove]] = {}
        self._moves: dict[tuple[tuple[str, str] | None, int, int], SlotMove] = {}

    def start(self, fid: int, slot: int) -> Future[int]:
        """Starts expert ``fid``'s reads into ``slot`` -> a future of its bytes, set once all
        its pieces have landed (the first failure raised)."""
        pieces = self.source.pieces(fid, *self.slot_io(slot))
        done: Future[int] = Future()
        landing = _Landing(len(pieces), done)
        for piece in pieces:
            self.pool.submit(landing.run, piece)
        return done

    def read_now(self, fid: int, slot: int) -> int:
        """Reads expert ``fid`` into ``slot`` in the calling thread -> its bytes."""
        return sum(p() for p in self.source.pieces(fid, *self.slot_io(slot)))

    def slot_io(self, slot: int) -> tuple[dict[str, Tensor], SlotMove]:
        """``slot``'s rows and how a piece goes into them (``_mover``), made once a slot (~0.15
        ms of Python a fill otherwise)."""
        io = self._io.get(slot)
        if io is None:
            dest = {p: expert_rows(self.slots, p, slot, 1)[0] for p in ("gate_up", "down")}
            io = self._io[slot] = (dest, self._mover(slot, dest))
        return io

    def _mover(self, slot: int, dest: dict[str, Tensor]) -> SlotMove:
        """``slot``'s ``SlotMove``: one per pair of block types and the slot's row counts."""
        pair = layer_pair(self.slots, slot) if self.slots.interleaved else None
        key = (pair, dest["gate_up"].shape[0], dest["down"].shape[0])
        move = self._moves.get(key)
        if move is None:
            qtypes: dict[str, str | None] = {"gate": None, "up": None, "down": None}
            if pair is not None:
                gate_up, down = pair
                if interleaves("gate_up", gate_up, key[1]):
                    qtypes["gate"] = qtypes["up"] = gate_up
                if interleaves("down", down, key[2]):
                    qtypes["down"] = down
            move = self._moves[key] = SlotMove(qtypes)
        return move

    def close(self) -> None:
        """The readers end (the reads in flight first), then the source's descriptors."""
        self.pool.shutdown(wait=True)
        self.source.close()


@functools.cache
def _tier_read() -> Any:
    """The native read-and-move of a piece (native/dense/tier_read.cpp), None unbuilt."""
    try:
        # deferred: ftdense (native extension)
        import ftdense  # type: ignore[import-not-found]
    except ImportError:
        return None
    return getattr(ftdense, "tier_read", None)


class _Landing:
    """One expert's pieces in flight: the future is set when the last one ends."""

    def __init__(self, pieces: int, done: Future[int]) -> None:
        self.left, self.nbytes = pieces, 0
        self.error: BaseException | None = None
        self.done = done
        self.lock = threading.Lock()

    def run(self, piece: Callable[[], int]) -> None:
        n, err = 0, None
        try:
            n = piece()
        except BaseException as e:  # handed to the future
            err = e
        with self.lock:
            self.left -= 1
            self.nbytes += n
            if err is not None and self.error is None:
                self.error = err
            last = self.left == 0
        if last:
            if self.error is not None:
                self.done.set_exception(self.error)
            else:
                self.done.set_result(self.nbytes)
