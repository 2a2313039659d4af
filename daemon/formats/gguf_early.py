"""A GGUF file's routed experts read into their host banks while the daemon imports torch.

A start-up spends its first seconds importing torch, on one core, and then reads the experts
(most of the file) into the banks. Neither needs the other: the banks of a GGUF file whose
experts stay in their blocks are the file's expert rows regrouped (gate and up rows together per
expert, the layers of a type in one bank, rows interleaved for the cpu backend), which the header
alone lays out. ``start`` (called by the CLI before the torch imports) parses the header, lays the
banks out in anonymous memory and fills them from the file on native threads that need neither
torch nor the interpreter (``ftdense.fill_rows``, the GIL released for the whole call), so the
read and the regrouping run on the cores the import leaves idle, or beside the disk on a cold
start. The GGUF loader then ``take``s the fill: where its own banks would have the same layout
(``EarlyFill.matches``: the same file, banks, experts and interleaving) it wraps this memory as
the banks (``torch.frombuffer``, no copy) and waits for the fill where it would have waited for
its own; otherwise it cancels the fill and loads as before.

The fill runs a MoE layer at a time, in the order the file holds them, and says which layers
are in (``wait_layer``), so the daemon need not wait for the whole pool before it serves: the
loader hands a fill still running to the cpu backend (``ExpertBanks.filling``), whose prompt
steps wait in each MoE layer for that layer's experts alone (a first prompt computes its early
layers while the later ones are read) and whose first decode step (the native decode step reads
every layer's banks) waits for the whole fill (issue 45's "serves before the pool is read").

It is a guess made before the settings that decide the load are resolved, so ``start`` guesses
only where the load is likely to take it: a single GGUF file whose experts are all in block types
the integer-dot kernels compute, or all BF16, loaded as stored (no quantize settings) under the
cpu backend (``moe_backend`` cpu, or auto with no NVIDIA device present), with the disk tier not
forced and the experts fitting in half of the available memory (the disk tier's case is left to
the loader). Banks laid out with ``block_layout`` (the same grouping ``experts.formats``
allocates). The fill runs at a lower priority (``FILL_NICE``) than the start-up it overlaps.

Where the experts are all in the page cache already (``cached``: a warm start), the fill is held
back until the loader takes it: reading them is then copying memory, not waiting for a disk, and
done beside torch's import it slowed the import more than it saved (BF16 file of bench_server,
AMD EPYC Zen 4 VM, 2 cores: a warm start served after 3.36 s with the fill beside the import,
2.87 s with no early fill, the loader copying every expert before it serves). The daemon serves
while the experts are copied.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runtime import readahead
from .block_layout import (
    BLOCK_INPUTS,
    QTYPE_CODES,
    interleaves,
    layer_banks,
    row_bytes,
)
from .gguf_header import GgufFormatError, GgufHeader, GgufTensor, expert_stacks, read_header

log = logging.getLogger(__name__)

_NVIDIA = ("/dev/nvidiactl", "/dev/nvidia0")
# the loader's tensors this close together (no expert between them) are read ahead as one range
# (the padding between tensors)
DENSE_GAP = 1 << 20
# The fill threads' nice value: they yield the cores to the start-up's own thread (torch's
# import, the dense weights' reads), which decides when the daemon serves; the fill, which it
# does not wait for, takes what that thread leaves. BF16 file of bench_server (5.4 GB, 4.8 GB of
# experts), warm, time to /health, 5 starts each alternated, AMD EPYC Zen 4 VM (2 cores, shared,
# load ~3.7): nice 0 4.46 s, 10 3.77 s, 19 3.78 s (medians).
FILL_NICE = 10
# BF16 experts (every layer's) load as they are into the float banks (bf16) the cpu backend
# computes from: this name in ``EarlyFill.pairs``, bank rows of 2 bytes an input
FLOAT = "bf16"


@dataclass(eq=False)  # identity: the fills started are kept in a WeakSet
class EarlyFill:
    """The banks being filled (name -> anonymous memory and its shape [experts, rows, row
    bytes], uint8) for ``header``'s file; ``blocks``: the decoder layer of each MoE layer in
    order, ``pairs`` their (gate_up, down) block types (``FLOAT``: bf16), ``interleave``: rows
    interleaved where ``block_layout.interleaves`` says (the cpu backend's layout)."""

    header: GgufHeader
    blocks: list[int]
    pairs: list[tuple[str, str]]
    experts: int
    interleave: bool
    memory: dict[str, mmap.mmap]
    shapes: dict[str, tuple[int, int, int]]
    error: BaseException | None = None
    _thread: threading.Thread | None = None
    _cancel: Any = field(default_factory=lambda: ctypes.c_uint8(0))
    # the MoE layers whose rows are all in; notified as each one completes and when the fill ends
    _in: set[int] = field(default_factory=set)
    _changed: threading.Condition = field(default_factory=threading.Condition)
    # set: the fill may run (at once where the file is not all in the page cache, else once
    # the loader takes it or anything waits for it: ``release``)
    _go: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        """Lets a fill held back (the file in the page cache, ``start``) run."""
        self._go.set()

    @property
    def floats(self) -> bool:
        """Whether the banks are the float (bf16) banks of a BF16 file's experts."""
        return self.pairs[0][0] == FLOAT

    def wait(self) -> None:
        """Returns once every row is in; raises what stopped the fill."""
        self.release()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        """Whether the fill has ended (every row in, or stopped by an error or ``stop``)."""
        return self._thread is None or not self._thread.is_alive()

    def wait_layer(self, moe_layer: int) -> None:
        """Returns once MoE layer ``moe_layer``'s rows are all in; raises what stopped the fill
        before they were."""
        self.release()
        with self._changed:
            while moe_layer not in self._in and not self.done():
                self._changed.wait(0.5)  # the timeout: a thread that died without notifying
        if moe_layer not in self._in:
            self.wait()  # raises the fill's error
            raise GgufFormatError(
                f"{self.header.path}: the early fill ended without MoE layer {moe_layer}"
            )

    def _layer_in(self, moe_layer: int) -> None:
        with self._changed:
            self._in.add(moe_layer)
            self._changed.notify_all()

    def stop(self) -> None:
        """Stops the fill: pieces not yet started are skipped, those in flight end."""
        self._cancel.value = 1
        self.release()
        if self._thread is not None:
            self._thread.join()

    def cancel(self) -> None:
        """``stop``, and frees the memory (not wrapped as banks: ``matches`` was False)."""
        self.stop()
        for m in self.memory.values():
            m.close()
        self.memory.clear()

    def matches(self, path: Path, blocks: list[int], experts: int, interleave: bool) -> bool:
        """Whether the loader of ``path`` (its MoE layers' decoder layers ``blocks``, ``experts``
        a layer, banks interleaved or not) would lay out the banks as these are."""
        return (
            _same(self.header.path, Path(path))
            and self.header.current()
            and self.blocks == blocks
            and self.experts == experts
            and self.interleave == interleave
        )


_pending: EarlyFill | None = None
# every fill started, until it is freed: stopped at exit (``_stop_running``)
_started: weakref.WeakSet[EarlyFill] = weakref.WeakSet()


@atexit.register
def _stop_running() -> None:
    """Stops the fills still running when the interpreter exits (a daemon stopped within
    seconds of its start, the experts still streaming in). Left running, a fill's native
    threads write into banks that the interpreter's finalization frees (a segmentation
    fault in the fill's copy), or the thread is ended by the finalization inside
    ``fill_rows`` with its workers unjoined (``std::terminate``, SIGABRT): the daemon's
    SIGTERM then ends in a crash and a core file instead of exit status 0."""
    for fill in list(_started):
        if not fill.done():
            fill.stop()


def take(path: str | Path) -> EarlyFill | None:
    """The fill started for ``path`` (handed out once), None when there is none."""
    global _pending
    fill, _pending = _pending, None
    if fill is not None and not _same(fill.header.path, Path(path)):
        fill.cancel()
        return None
    if fill is not None:
        fill.release()
    return fill


def _same(a: Path, b: Path) -> bool:
    try:
        return a == b or a.resolve() == b.resolve()
    except OSError:
        return False


def likely(cfg: Any) -> bool:
    """Whether a daemon with these settings (``config.DaemonConfig``) loads a GGUF file's block
    experts as stored into interleaved host banks, as far as can be told without torch."""
    if not cfg.model or cfg.disk_tier == "on" or cfg.quantize or cfg.quantize_experts:
        return False
    if cfg.accelerator in ("fake-cuda", "cuda") or cfg.moe_backend not in ("cpu", "auto"):
        return False
    return not (cfg.moe_backend == "auto" and any(os.path.exists(p) for p in _NVIDIA))


def start(cfg: Any) -> EarlyFill | None:
    """Starts filling the banks of ``cfg.model`` where ``likely`` (see the module doc); the
    fill, or None (nothing started)."""
    global _pending
    if not likely(cfg):
        return None
    files = readahead.model_files(cfg.model)
    if len(files) != 1:
        return None
    try:
        import ftdense  # type: ignore[import-not-found]  # deferred: ftdense (native extension)
    except ImportError:
        return None
    if not hasattr(ftdense, "fill_rows"):
        return None
    try:
        header = read_header(files[0])
    except GgufFormatError:
        return None  # the loader reports it
    layout = _layout(header.tensors)
    free = readahead.free_bytes()
    if layout is None or free is None or _bytes(layout[3]) > free // 2:
        return None
    blocks, pairs, experts, shapes = layout
    interleave = hasattr(ftdense, "qinterleave") and pairs[0][0] != FLOAT
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    memory = {n: mmap.mmap(-1, max(1, _bytes({n: s})), flags=flags) for n, s in shapes.items()}
    fill = EarlyFill(header, blocks, pairs, experts, interleave, memory, shapes)
    if not cached(header):
        fill.release()
    jobs = _layer_jobs(fill)
    fill._thread = threading.Thread(
        target=_run, args=(fill, ftdense, jobs), name="ft-early-fill", daemon=True
    )
    fill._thread.start()
    _started.add(fill)
    _pending = fill
    return fill


def cached(header: GgufHeader, samples: int = 3) -> bool:
    """Whether the file's expert stacks look all in the page cache: ``samples`` pages of each
    (its first, last and between) read without waiting for the disk (RWF_NOWAIT). False where
    the kernel cannot tell."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or not hasattr(os, "preadv"):
        return False
    buf = bytearray(4096)
    try:
        fd = os.open(header.path, os.O_RDONLY)
    except OSError:
        return False
    try:
        for parts in expert_stacks(header.tensors).values():
            for t in parts.values():
                last = max(0, t.nbytes - len(buf))
                for k in range(samples):
                    at = t.offset + last * k // max(1, samples - 1)
                    if os.preadv(fd, [buf], at, flag) <= 0:
                        return False
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: the kernel cannot say
        return False
    finally:
        os.close(fd)
    return True


def _bytes(shapes: dict[str, tuple[int, int, int]]) -> int:
    return sum(e * r * b for e, r, b in shapes.values())


def _row_bytes(qtype: str, cols: int) -> int:
    return cols * 2 if qtype == FLOAT else row_bytes(qtype, cols)


def _layout(
    tensors: dict[str, GgufTensor],
) -> tuple[list[int], list[tuple[str, str]], int, dict[str, tuple[int, int, int]]] | None:
    """(decoder layer of each MoE layer, their block types, experts a layer, bank shapes) of the
    file's stacked expert weights, None where they cannot stay as they are in one set of banks:
    block types the integer-dot kernels compute, or BF16 in every layer (the float banks the
    loader reads a BF16 file's experts into, ``FLOAT`` in the pairs: bytes as they are)."""
    types = expert_stacks(tensors)
    blocks = sorted(types)
    if not blocks:
        return None
    pairs, dims = [], set()
    for b in blocks:
        parts = types[b]
        if set(parts) != {"gate", "up", "down"}:
            return None
        g, u, d = parts["gate"], parts["up"], parts["down"]
        gu, dn = g.type_name.lower(), d.type_name.lower()
        if u.type_name != g.type_name or not (
            (gu in QTYPE_CODES and dn in QTYPE_CODES) or gu == dn == FLOAT
        ):
            return None
        if len(g.shape) != 3 or g.shape != u.shape or d.shape != (g.shape[0], *g.shape[:0:-1]):
            return None
        experts, inter, hidden = g.shape
        if gu != FLOAT and (hidden % BLOCK_INPUTS[gu] or inter % BLOCK_INPUTS[dn]):
            return None
        pairs.append((gu, dn))
        dims.add((experts, inter, hidden))
    if len(dims) != 1 or (len(set(pairs)) > 1 and (FLOAT, FLOAT) in pairs):
        return None  # (the float banks hold every layer: no blocks beside them)
    experts, inter, hidden = dims.pop()
    shapes = {}
    for name, proj, qtype, layers in layer_banks(pairs):
        rows, cols = (2 * inter, hidden) if proj == "gate_up" else (hidden, inter)
        shapes[name] = (experts * len(layers), rows, _row_bytes(qtype, cols))
    return blocks, pairs, experts, shapes


def _address(m: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(view)
    finally:
        del view


Job = tuple[int, int, int, int, int, int]


def _layer_jobs(fill: EarlyFill) -> list[tuple[int, list[Job]]]:
    """``ftdense.fill_rows``'s jobs by MoE layer: (MoE layer, each of its experts' gate, up and
    down rows into their bank rows, in file order), the layers in the order of their first byte
    in the file."""
    tensors, e = fill.header.tensors, fill.experts
    where = {}  # (MoE layer, projection) -> (bank, rank of the layer in it)
    for name, proj, _, ranked in layer_banks(fill.pairs):
        for rank, layer in enumerate(ranked):
            where[layer, proj] = (name, rank)
    layers: list[tuple[int, list[Job]]] = []
    for moe, (b, (gu, dn)) in enumerate(zip(fill.blocks, fill.pairs, strict=True)):
        jobs: list[Job] = []
        layers.append((moe, jobs))
        for proj, qtype in (("gate", gu), ("up", gu), ("down", dn)):
            t = tensors[f"blk.{b}.ffn_{proj}_exps.weight"]
            bank, rank = where[moe, "down" if proj == "down" else "gate_up"]
            n, rows, rb = fill.shapes[bank]
            base = _address(fill.memory[bank])
            half = t.shape[1]  # gate or up: the first or second half of gate_up's rows
            per = half * rb
            cols = t.shape[2]
            x8 = fill.interleave and interleaves(
                "down" if proj == "down" else "gate_up", qtype, rows
            )
            code = QTYPE_CODES[qtype] if x8 else -1
            for x in range(e):
                dest = base + ((rank * e + x) * rows) * rb + (per if proj == "up" else 0)
                jobs.append((t.offset + x * per, per, dest, code, half, cols))
        jobs.sort()
    return sorted(layers, key=lambda lj: lj[1][0])


def dense_ranges(header: GgufHeader) -> list[tuple[int, int]]:
    """The file's byte ranges (offset, length) of every tensor but the stacked experts, adjacent
    tensors merged, in file order: what the loader reads itself."""
    experts = {t.name for parts in expert_stacks(header.tensors).values() for t in parts.values()}
    out: list[tuple[int, int]] = []
    joins = False  # whether the next tensor may extend the last range (no expert in between)
    for t in sorted(header.tensors.values(), key=lambda t: t.offset):
        if t.name in experts:
            joins = False
        elif t.nbytes > 0:
            if joins and t.offset - (out[-1][0] + out[-1][1]) <= DENSE_GAP:
                out[-1] = (out[-1][0], t.offset + t.nbytes - out[-1][0])
            else:
                out.append((t.offset, t.nbytes))
            joins = True
    return out


def _run(fill: EarlyFill, ftdense: Any, layers: list[tuple[int, list[Job]]]) -> None:
    try:  # fill_rows' threads inherit this thread's nice value (Linux: per thread)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FILL_NICE)
    except (AttributeError, OSError):
        pass
    fill._go.wait()
    try:
        fd = os.open(fill.header.path, os.O_RDONLY)
    except OSError as e:
        fill.error = GgufFormatError(f"{fill.header.path}: cannot open ({e.strerror})")
        return
    try:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        for moe, jobs in layers:  # a call a layer: its threads end with the layer (~0.1 ms)
            if fill._cancel.value:
                break
            ftdense.fill_rows(fd, jobs, max(1, threads), ctypes.addressof(fill._cancel))
            if not fill._cancel.value:  # (a stopped call skips the pieces not yet started)
                fill._layer_in(moe)
    except (RuntimeError, ValueError) as e:
        fill.error = GgufFormatError(f"{fill.header.path}: the experts cannot be read ({e})")
    finally:
        os.close(fd)
        with fill._changed:  # a waiter for a layer that will not come in learns it now
            fill._changed.notify_all()
