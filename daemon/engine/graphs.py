"""A decode step in static form, and CUDA graphs of it per batch-size bucket (ARCHITECTURE §4.6).

A decode batch (every row one token) of an attention-only model runs through one function,
``decode_forward``, whose inputs are a single device tensor of metadata, ``meta`` [B, 4 + W]
int64: per row its token id, position, key count (``lens``, its own key included), the pool row
its K/V is written to, then its page table padded to W pages. Attention writes and reads the pool
through these on the device (``models.layers.attention._static_decode``), so no shape, index or
bound of the step depends on a context length, a page number or a routed expert: the same ops
on the same shapes run for any step of a given (B, W). The runner uses this form for every
decode batch on a device (eager), and ``DecodeGraphs`` captures it once per (B, W) bucket and
replays it (tests/test_decode_graphs.py checks on the fake CUDA card that two steps of a bucket
record the same op sequence, with no host sync).

Buckets: batch sizes ``BATCH_BUCKETS`` (a batch of 3 replays the graph of 4, its extra row a
padding row: token 0 at position 0 writing to a reserved scratch page, its logits dropped) and
page-table widths in powers of two from ``MIN_WIDTH`` pages up to the longest context's pages.
The padding row computes like a real one (its experts included: always the same token, so with
a slot cache its experts stay resident after the first step).

Graphs are captured at start (``capture_all``; a log line names the buckets) with
``cuda_graphs`` on, on a real CUDA device with the ``fused`` or ``offload`` backend (their plan,
fills and GEMVs stay on the device). Everything else runs eagerly with one log line saying why:
``hybrid`` (its CPU share joins on the host each MoE layer), a model with layers that have no
static decode form (Gated DeltaNet, MLA, Gemma-4's own top level), a step with a prompt chunk, a
batch above the largest bucket or a context above the widest table, a failed capture. A replay
checks that the tensors the graphs read (KV pool, rope tables, expert banks, dense weights) are
still where they were captured; after a resize they have moved, and the graphs are captured
again (logged) before the next replay. A park (manager/models.py) releases the graphs with their
memory pool (``release``) and unpark captures them again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..experts.fakecuda.session import active_session
from ..models.batch import DecodeMeta, ForwardBatch
from ..models.layers.attention import Attention
from ..models.model import CausalLM
from ..runtime.staging import pinned

if TYPE_CHECKING:
    from ..kv.seq_state import SeqState
    from ..models.model import CausalLM
    from .runner import ModelRunner

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8)
MIN_WIDTH = 4  # pages: the narrowest page-table width bucket
COLS = 4  # meta columns before the page table: token, position, lens, KV row
WARMUP = 2  # eager runs on a side stream before a capture (allocator, autotuned kernels)
GRAPH_BACKENDS = ("fused", "offload")


# ---- buckets ---------------------------------------------------------------------------------
def batch_bucket(n: int, buckets: Sequence[int] = BATCH_BUCKETS) -> int | None:
    """The smallest bucket holding ``n`` rows; None above the largest."""
    return next((b for b in sorted(buckets) if b >= n), None)


def width_for(pages: int, max_pages: int | None = None, min_width: int = MIN_WIDTH) -> int:
    """The page-table width of a batch whose longest row needs ``pages`` pages: the next power
    of two from ``min_width``, at most ``max_pages`` (the widest table; None: unbounded)."""
    w = max(min_width, 1 << max(0, pages - 1).bit_length())
    if max_pages is not None:
        w = min(w, max_pages)
    return max(w, pages)


def width_buckets(max_pages: int, min_width: int = MIN_WIDTH) -> tuple[int, ...]:
    """Every width ``width_for`` gives for tables of 1..``max_pages`` pages."""
    out, w = [], min(min_width, max_pages)
    while True:
        out.append(w)
        if w >= max_pages:
            return tuple(out)
        w = min(2 * w, max_pages)


def static_decode_blocker(model: CausalLM) -> str | None:
    """Why ``model`` has no static decode form (None: it has one): every token mixer must be
    softmax attention over the paged pool, under the shared top level."""

    if type(model) is not CausalLM:
        return f"{type(model).__name__} has its own forward"
    for i, layer in enumerate(model.layers):
        if layer.linear_attn is not None:
            return f"layer {i} is Gated DeltaNet (per-sequence recurrent state)"
        if not isinstance(layer.self_attn, Attention):
            return f"layer {i} is {type(layer.self_attn).__name__}"
    return None


# ---- the static step -------------------------------------------------------------------------
def pack_decode(
    states: Sequence[SeqState],
    tokens: Sequence[int],
    page_size: int,
    rows: int,
    width: int,
    pad_page: int | None = None,
) -> torch.Tensor:
    """The host metadata [rows, COLS + width] int64 of decode rows feeding ``tokens[i]`` after
    ``states[i]``'s cached tokens (pages reserved); rows past ``len(states)`` are padding rows
    (token 0 at position 0 over ``pad_page``). Unused table entries repeat a valid page of the
    row (masked by its lens)."""
    n = len(states)
    if n > rows:
        raise ValueError(f"{n} decode rows do not fit a bucket of {rows}")
    if n < rows and pad_page is None:
        raise ValueError("padding rows need a scratch page")
    out: list[list[int]] = []
    for st, tok in zip(states, tokens, strict=True):
        pos = st.num_tokens
        need = -(-(pos + 1) // page_size)
        if need > width:
            raise ValueError(f"a row of {pos + 1} keys needs {need} pages, over width {width}")
        table = st.pages[:need]
        slot = table[pos // page_size] * page_size + pos % page_size
        out.append([tok, pos, pos + 1, slot, *table, *[table[0]] * (width - need)])
    if n < rows:
        assert pad_page is not None
        out.extend([[0, 0, 1, pad_page * page_size, *[pad_page] * width]] * (rows - n))
    return torch.tensor(out, dtype=torch.long).view(rows, COLS + width)


def decode_batch(runner: ModelRunner, meta: torch.Tensor) -> ForwardBatch:
    """The ForwardBatch of device metadata ``meta`` [B, COLS + W] (``pack_decode``'s layout):
    views and casts on the device only."""
    b, width = meta.shape[0], meta.shape[1] - COLS
    rows = torch.arange(b, dtype=torch.int32, device=meta.device)
    dm = DecodeMeta(
        lens=meta[:, 2].int(),
        slots=meta[:, 3],
        tables=meta[:, COLS:].int(),
        rows=rows,
        max_len=width * runner.kv.page_size,
    )
    return ForwardBatch(
        token_ids=meta[:, 0],
        positions=meta[:, 1],
        chunks=[],
        kv=runner.kv,
        moe=runner.moe,
        logits_rows=rows.long(),
        max_position=dm.max_len - 1,  # the bound, not the batch's: the rope table never grows
        decode=dm,
    )


def decode_forward(runner: ModelRunner, meta: torch.Tensor) -> torch.Tensor:
    """The decode step a graph captures: logits [B, vocab] of metadata ``meta`` (on the
    device). Call it within the runner's decode scope (``ModelRunner.decode_scope``)."""
    return runner.model(decode_batch(runner, meta))


# ---- graphs ----------------------------------------------------------------------------------
class Captured:
    """One captured step: ``replay()`` reruns it on what ``meta`` holds; results in ``out``."""

    def __init__(self, replay: Callable[[], None], out: torch.Tensor, keep: Any = None) -> None:
        self.replay, self.out, self.keep = replay, out, keep


Capture = Callable[[Callable[[], torch.Tensor]], Captured]


def cuda_capture(pool: Any = None) -> Capture:
    """Captures with ``torch.cuda.CUDAGraph`` after ``WARMUP`` eager runs on a side stream;
    every graph of the set shares the memory ``pool``."""

    def capture(fn: Callable[[], torch.Tensor]) -> Captured:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return Captured(graph.replay, out, graph)

    return capture


@dataclass
class _Graph:
    meta: torch.Tensor  # [B, COLS + W] device: the static input
    captured: Captured


class DecodeGraphs:
    """Decode graphs of ``runner`` per (batch bucket, width bucket), replayed by ``run``.

    ``capture`` does the capturing (default: ``cuda_capture``; tests inject an eager stand-in
    that reruns the function on replay). A scratch KV page is reserved for padding rows."""

    def __init__(
        self,
        runner: ModelRunner,
        max_pages: int,
        batches: Sequence[int] = BATCH_BUCKETS,
        capture: Capture | None = None,
        min_width: int = MIN_WIDTH,
    ) -> None:
        self.runner = runner
        self.max_pages = max(1, min(max_pages, runner.kv.num_pages - 1))
        self.batches = tuple(sorted(batches))
        self.widths = width_buckets(self.max_pages, min_width)
        self.min_width = min_width
        self._capture = capture
        self.pad_page: int | None = runner.kv.alloc(1)[0]
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.disabled: str | None = None  # why graphs are off (a failed capture)
        self.replays = 0
        self._fingerprint: tuple[Any, ...] = ()
        self._logged: set[str] = set()

    # -- capture -----------------------------------------------------------------------------
    def capture_all(self) -> bool:
        """Captures every bucket; on a failure logs the reason once, drops the graphs and
        leaves decode eager. Returns whether the graphs are in use."""
        t0 = time.perf_counter()
        capture = self._capture or cuda_capture(torch.cuda.graph_pool_handle())
        self.graphs.clear()
        if self.pad_page is None:  # released (a park)
            self.pad_page = self.runner.kv.alloc(1)[0]
        self._grow_rope()  # the rope table at the widest bound first: no capture sees it grow
        joins = getattr(self.runner.moe, "_cpu_possible", None)
        top_k = max(1, self.runner.cfg.top_k)
        skipped = [b for b in self.batches if joins is not None and joins(b * top_k)]
        try:
            for b in (b for b in self.batches if b not in skipped):
                for w in self.widths:
                    meta = pack_decode([], [], self.runner.kv.page_size, b, w, self.pad_page)
                    dev = meta.to(self.runner.kv.device)
                    with self.runner.decode_scope(b):
                        cap = capture(functools.partial(decode_forward, self.runner, dev))
                    self.graphs[(b, w)] = _Graph(dev, cap)
        except Exception as e:  # noqa: BLE001 - any capture failure: eager decode, logged
            self.graphs.clear()
            self.disabled = f"capture failed ({type(e).__name__}: {e})"
            log.warning("cuda graphs: %s; decode runs without graphs", self.disabled)
            return False
        self._fingerprint = self.fingerprint()
        captured = [b for b in self.batches if b not in skipped]
        log.info(
            "cuda graphs: captured batch buckets %s x page-table widths %s (%d graphs) in %.1f s",
            captured, list(self.widths), len(self.graphs), time.perf_counter() - t0,
        )  # fmt: skip
        if skipped:
            log.info(
                "cuda graphs: batch buckets %s not captured: more routes than expert slots "
                "(a route may go to the CPU)", skipped,
            )  # fmt: skip
        return True

    def release(self) -> None:
        """Drops the captured graphs (with them their memory pool) and frees the scratch page,
        for a park: the device is the next model's. ``capture_all`` captures them again (so
        does the next ``run``: the stale fingerprint asks for it)."""
        self.graphs.clear()
        self._fingerprint = ()
        if self.pad_page is not None:
            self.runner.kv.free([self.pad_page])
            self.pad_page = None
        if self.runner.kv.device.type == "cuda":
            torch.cuda.empty_cache()  # the pool's blocks back to the driver

    def _grow_rope(self) -> None:
        rope = self.runner.model.rope
        bound = self.widths[-1] * self.runner.kv.page_size
        pos = torch.zeros(1, dtype=torch.long, device=self.runner.kv.device)
        rope.cos_sin(pos, bound - 1)

    def fingerprint(self) -> tuple[Any, ...]:
        """Where the tensors a graph reads live (address, shape): KV pool, rope tables, expert
        banks and cache state, the embedding and lm_head weights (a park moves every dense
        weight, these among them)."""
        r = self.runner
        ts: list[torch.Tensor] = []
        for side in (r.kv.k, r.kv.v):
            ts.extend(side if isinstance(side, list) else [side])
        rope = r.model.rope
        ts += [rope._cos, rope._sin, r.model.embed_tokens.weight, r.model.lm_head.weight]
        moe = r.moe
        for name in ("dev", "slots"):
            banks = getattr(moe, name, None)
            if banks is not None:
                ts.extend(banks.tensors().values())
        cache = getattr(moe, "cache", None)
        if cache is not None:
            ts.extend(t for t in vars(cache.state).values() if isinstance(t, torch.Tensor))
        return tuple((t.data_ptr(), tuple(t.shape)) for t in ts)

    # -- replay ------------------------------------------------------------------------------
    def run(self, states: Sequence[SeqState], tokens: Sequence[int]) -> torch.Tensor | None:
        """Logits [n, vocab] of one decode step by replay (pages reserved; the caller advances
        the states), or None (logged once per reason) where this step runs eagerly."""
        if self.disabled is not None:
            return None
        n = len(states)
        b = batch_bucket(n, self.batches)
        if b is None:
            return self._eager(f"a batch of {n} rows is above the largest bucket")
        ps = self.runner.kv.page_size
        pages = max(-(-(st.num_tokens + 1) // ps) for st in states)
        if pages > self.max_pages:
            return self._eager(f"a context of {pages} pages is above the widest table")
        w = width_for(pages, self.max_pages, self.min_width)
        if self.fingerprint() != self._fingerprint:
            log.info("cuda graphs: the pool, banks or weights moved (resize/park); recapturing")
            if not self.capture_all():
                return None
        g = self.graphs.get((b, w))
        if g is None:
            return self._eager(f"batch bucket {b} has no graph (more routes than expert slots)")
        host = pack_decode(states, tokens, ps, b, w, self.pad_page)
        if g.meta.device.type == "cuda":
            g.meta.copy_(pinned(host), non_blocking=True)
        else:
            g.meta.copy_(host)
        g.captured.replay()
        self.replays += 1
        return g.captured.out[:n].clone()

    def _eager(self, reason: str) -> torch.Tensor | None:
        """None (the step runs eagerly), logged once per reason."""
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("cuda graphs: %s; that step runs without a graph", reason)
        return None


def graphs_blocker(backend: str, device: torch.device, model: CausalLM) -> str | None:
    """Why ``cuda_graphs`` cannot capture here (None: it can)."""
    if device.type != "cuda":
        return f"the dense part runs on {device.type}, not a CUDA device"
    if backend not in GRAPH_BACKENDS:
        if backend == "hybrid":
            return "hybrid joins its CPU share on the host in every MoE layer"
        return f"backend {backend} has no device-side decode plan"

    if active_session() is not None:
        return "the fake CUDA device cannot run torch.cuda graphs"
    return static_decode_blocker(model)
