"""Native CPU dense projection (extension module `ftdense`, built from native/dense/).

    y = x.to(bfloat16) @ W^T  with fp32 accumulation and fp32 output,  W [N, K] bf16 (or fp32)

torch's CPU bf16 matmul runs at ~1 GB/s of weights for one token on AVX2 machines (it widens and
repacks per call), and decode is a pure weight stream; `ftdense` runs the expert executor's
bandwidth-bound gemv kernel for a few tokens and its register-tiled kernel for many, on a small
pool in which the calling thread takes part. The reference is `linear_reference` (plain torch).

It also runs decode attention straight from the paged KV pool (`decode_attention`, reference
`decode_attention_reference`): one call per layer for all decode rows instead of a gather, an fp32
copy of the context and torch attention; and the causal attention of prompt chunks the same way
(`prefill_attention`, reference `prefill_attention_reference`), tiled, one call per layer.

When the extension is not built, `usable` and `attention_usable` are False and callers keep the
torch path. They are also False inside ``torch_only()``: the engine enters it when the dense part
runs on an accelerator (engine/placement.py), so that the CPU stand-in runs the device code path
(torch ops), not these host kernels.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from ..runtime import cpu_isa

_native: Any
try:
    import ftdense as _native  # type: ignore[import-not-found,no-redef]
except ImportError:  # not built: Linear keeps its torch path
    _native = None

# Captured at import, before any decode step narrows torch's threads (engine/runner.py).
_DEFAULT_THREADS = torch.get_num_threads()
_DTYPES = (torch.bfloat16,)  # fp32 weights stay on torch: its fp32 gemv is near bandwidth already
_TORCH_ONLY: ContextVar[bool] = ContextVar("ftdense_torch_only", default=False)


@contextmanager
def torch_only() -> Iterator[None]:
    """Within the block every ``*_usable`` check is False: callers take their torch path."""
    token = _TORCH_ONLY.set(True)
    try:
        yield
    finally:
        _TORCH_ONLY.reset(token)


def _on() -> bool:
    """The extension is built and not switched off by ``torch_only``."""
    return _native is not None and not _TORCH_ONLY.get()


def available() -> bool:
    """True when the `ftdense` extension is importable."""
    return _native is not None


# How long the pool's idle workers spin before sleeping (microseconds), by what else runs on the
# cores between its jobs. Float experts run on the native executor's own threads (cpu_executor):
# a worker spinning through that call would take a core from them, so it sleeps after 50 us.
# GGUF block experts run on this pool (block_executor): every job of a decode step is its own,
# and a worker that spins through the step's Python between two steps (0.1-0.3 ms) starts the
# next step's first job without a wake-up (on a 2-vCPU VM a wake-up measured 25-70 us). Decode
# of the benchmark's Q4_K_M file, 1000 against 50, alternated in one process: 1.010x, 1.029x;
# MXFP4 1.002x; a bf16 model with 1000: 0.98x.
SPIN_US_SHARED = 50
SPIN_US_OWN = 1000
# The HTTP daemon caps every model's spin at SPIN_US_SHARED (cap_spin): between two of its steps
# the engine thread hands the step's tokens to the event loop's thread, which turns them into
# SSE frames (Python, a few tenths of a ms a token), and on two cores a worker spinning through
# that holds the core one of the two threads needs: the hand-off measured 0.6-1.0 ms a step
# (1 / 4 streams) spinning 1000 us, 0.12-0.15 ms at 50 (freetokend, the server benchmark's Q4_K_M
# file, 2-core AMD EPYC Zen 3 VM, servers interleaved, a shared machine: a decode step of 1 / 4 /
# 8 streams 18.9 / 46.9 / 83.0 ms against 20.0 / 47.3 / 84.8 ms, medians over 3 rounds).
# Within one native decode step (the decode lane's one call a step) the workers spin at least
# 1 ms between jobs anyway and stop when the step ends (pool.h, Pool::Hold): capped at 50 us,
# a worker slept through the step's short single-threaded parts and each next job waited for
# its wake-up (freetokend, that file, AMD EPYC Zen 4 VM, alternated runs: the step 6.0-7.3 ms
# against 6.8-7.5 at 1 stream, 17.0-17.6 against 17.3-17.9 ms at 4).
_spin_cap: int | None = None


def configure(
    threads: int | None = None,
    isa: str = "auto",
    spin_us: int = SPIN_US_SHARED,
    bf16_attention: bool | None = None,
) -> None:
    """(Re)creates the pool: `threads` participants including the caller (default: torch's
    intra-op thread count at import), the kernels of `isa` ("auto", "avx512bf16", "avx512",
    "avx2", "scalar", or "emu512" / "emubf16" in tests). "avx512bf16" (opt-in: auto does not take
    it) runs bf16 weights on vdpbf16ps: the same x.to(bf16) @ W^T in fp32. ``bf16_attention``:
    with a bf16-dot `isa`, the prefill attention on its kernels too (queries and weights rounded
    to bf16), and the decode attention over a bf16 pool through them (`decode_attention`);
    None: so for a direct call naming that ISA (the kernel tests), the engine passes its
    ``cpu_bf16_attention`` (engine/build.cpu_isa)."""
    if _native is None:
        raise ImportError("the native dense projection (extension module `ftdense`) is not built")
    isa = cpu_isa.resolve(isa)  # FREETOKEN_CPU_ISA forces "auto"
    on = isa in ("avx512bf16", "emubf16") if bf16_attention is None else bf16_attention
    _native.configure(threads or _DEFAULT_THREADS, spin_us, isa, on)


def set_spin(spin_us: int) -> None:
    """Sets how long the configured pool's idle workers spin before sleeping (at most the cap
    of ``cap_spin``); no-op when the extension is not built or the pool not configured."""
    if _native is not None and _native.configured():
        _native.set_spin(spin_us if _spin_cap is None else min(spin_us, _spin_cap))


def cap_spin(spin_us: int | None) -> None:
    """Caps what ``set_spin`` sets from now on (None: no cap), for a process whose other
    threads need the cores between the pool's jobs (the HTTP daemon: SPIN_US_* says why)."""
    global _spin_cap
    if spin_us is not None and spin_us < 0:
        raise ValueError("spin_us must be >= 0")
    _spin_cap = spin_us


def ensure_configured() -> None:
    """Configures the pool with its defaults unless it is configured: every native call that
    runs on the pool raises without one (the first one of a process configures it)."""
    if not _native.configured():
        configure()


def configured_isa() -> str:
    """The kernels the pool was configured with ("avx512bf16", "avx512", "avx2", "scalar", ...);
    "" when the extension is not built or configure() was not called."""
    if _native is None or not _native.configured():
        return ""
    return str(_native.isa())


def weight_usable(w: torch.Tensor) -> bool:
    """Whether `linear` takes this weight: extension built, a contiguous bf16 CPU tensor that
    needs no gradient."""
    return (
        _on()
        and w.dtype in _DTYPES
        and w.device.type == "cpu"
        and w.dim() == 2
        and w.is_contiguous()
        and not (w.requires_grad and torch.is_grad_enabled())
    )


def input_usable(x: torch.Tensor) -> bool:
    """Whether `linear` takes this input: [T, K] fp32 or bf16 on the CPU, needing no gradient."""
    return (
        _on()
        and x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear` takes x [T, K] and w [N, K]."""
    return weight_usable(w) and input_usable(x)


def linear_many(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] = ()
) -> list[torch.Tensor]:
    """x [T, K] -> [x.to(bf16) @ w^T (+ b) for each w], each [T, N_w] fp32, accumulated in fp32,
    in ONE pool job (the input is prepared once). Check `usable` for x and every weight first."""
    t, k = x.shape
    for w in weights:
        if w.shape[1] != k:
            raise ValueError(f"x has {k} features but a weight expects {w.shape[1]}")
    ensure_configured()
    xf = x.float().contiguous()
    ys = [torch.empty(t, w.shape[0], dtype=torch.float32) for w in weights]
    _native.linear(
        xf.data_ptr(),
        t,
        k,
        [w.data_ptr() for w in weights],
        [w.shape[0] for w in weights],
        [y.data_ptr() for y in ys],
        True,
        True,
    )
    for y, b in zip(ys, biases, strict=False):
        if b is not None:
            y += b
    return ys


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> [T, N] fp32 = x.to(w.dtype) @ w^T (+ bias), accumulated in fp32. Check
    `usable(x, w)` first."""
    return linear_many(x, (w,), (bias,))[0]


def rms_norm_usable(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `rms_norm` takes x [..., D] and scale [D]: fp32 CPU tensors, no autograd."""
    return (
        _on()
        and x.dtype == torch.float32
        and scale.dtype == torch.float32
        and x.device.type == "cpu"
        and scale.device.type == "cpu"
        and x.dim() >= 1
        and scale.shape == (x.shape[-1],)
        and not (torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad))
    )


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * scale in fp32 (torch's rms_norm costs ~17 us even for one
    row, several ops in one). Check `rms_norm_usable` first."""
    xc = x.contiguous()
    sc = scale.contiguous()
    y = torch.empty_like(xc)
    d = x.shape[-1]
    _native.rms_norm(
        xc.data_ptr(), xc.numel() // d if d else 0, d, sc.data_ptr(), eps, y.data_ptr()
    )
    return y


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """``torch.argmax(logits, dim=-1)`` of [B, V] fp32 CPU logits in one native pass (the first
    of equal maxima; NaN counts as the largest), or None where the native path does not apply.
    torch's takes ~135 us for a 50k vocabulary on one thread, a vectorised pass ~10."""
    if not (
        _on()
        and logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.device.type == "cpu"
        and logits.shape[1] > 0
    ):
        return None
    lc = logits.contiguous()
    out = torch.empty(lc.shape[0], dtype=torch.int64)
    _native.argmax_rows(lc.data_ptr(), lc.shape[0], lc.shape[1], out.data_ptr())
    return out


def rope_usable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rope` takes x [N, heads, head_dim] with cos/sin [N, rot/2]: fp32 CPU tensors,
    no autograd."""
    return (
        _on()
        and x.dim() == 3
        and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (x, cos, sin))
        and cos.dim() == 2
        and cos.shape == sin.shape
        and cos.shape[0] == x.shape[0]
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, interleaved: bool
) -> torch.Tensor:
    """``Rope.apply`` in one native call, bit for bit (native/dense/rope.h: torch's ~10 small
    ops cost more than the arithmetic at decode). Check `rope_usable` first."""
    xc, c, s = x.contiguous(), cos.contiguous(), sin.contiguous()
    n, heads, hd = xc.shape
    y = torch.empty_like(xc)
    _native.rope(
        xc.data_ptr(), n, heads, hd, rot, interleaved, c.data_ptr(), s.data_ptr(), y.data_ptr()
    )
    return y


def linear_reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What `linear` computes, in plain torch (fp32 math on the bf16-rounded input)."""
    y = x.to(w.dtype).float() @ w.float().t()
    return y + bias.float() if bias is not None else y


# ---- decode attention over the paged KV pool (native/dense/decode_attention.h) ----------------


def attention_usable(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    """Whether `decode_attention` takes q [N, heads, d] and one layer's K/V pages
    [num_pages, page_size, kv_heads, d]: extension built, fp32 q, bf16 or fp32 contiguous pages of
    one dtype, all on the CPU, no autograd."""
    return (
        _on()
        and q.dim() == 3
        and k_pages.dim() == 4
        and q.dtype == torch.float32
        and k_pages.dtype in (torch.bfloat16, torch.float32)
        and v_pages.dtype == k_pages.dtype
        and v_pages.shape == k_pages.shape
        and q.device.type == k_pages.device.type == v_pages.device.type == "cpu"
        and k_pages.is_contiguous()
        and v_pages.is_contiguous()
        and q.shape[2] == k_pages.shape[3]
        and q.shape[1] % k_pages.shape[2] == 0
        and not (torch.is_grad_enabled() and q.requires_grad)
    )


def decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one decode query per sequence, reading K/V straight from the paged pool.

    q [N, heads, d] fp32; k_pages, v_pages [num_pages, page_size, kv_heads, d] (one layer of the
    pool, bf16 or fp32); tables [n, max_pages] int32 page tables; lens [n] keys per sequence
    including the query's own (already written), so query i sits at position lens[i] - 1 and sees
    keys j with lens[i] - window <= j < lens[i]; sinks [heads] one extra softmax logit per head.
    ``rows`` [n] picks the rows of q (and of ``out``) that are the queries (default: all N, n = N).
    Returns ``out`` [N, heads, d] fp32 (new when not given; only the query rows are written).
    With the pool configured for the bf16 attention (`configure`) and bf16 pages, the queries
    run as prompt chunks of one row through the prefill kernel: the bits of `prefill_attention`.
    Check `attention_usable` first.
    """
    if rows is None:
        rows = torch.arange(q.shape[0], dtype=torch.int32)
    return _paged_call(
        _native.decode_attention, q, k_pages, v_pages, (rows, lens), tables, scale, window,
        sinks, out, "rows, lens and tables must describe the same number of queries",
    )  # fmt: skip


def _paged_call(
    fn: Any,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    arrays: Sequence[torch.Tensor],
    tables: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor | None,
    mismatch: str,
) -> torch.Tensor:
    """Calls one of the extension's paged attention entries (decode_attention,
    prefill_attention): fn(q, q_rows, out, heads, n, *arrays, tables, table_stride, k, v, bf16,
    num_pages, page_size, kv_heads, d, scale, window, sinks) on addresses, after checking that
    ``arrays`` ([n] each) and ``tables`` [n, W] agree (``mismatch`` otherwise), ``out`` and
    ``sinks``. Returns ``out`` (new when not given)."""
    ensure_configured()
    qc = q.contiguous()
    n_rows, heads, d = qc.shape
    ints = [t.to(torch.int32).contiguous() for t in arrays]
    ti = tables.to(torch.int32).contiguous()
    n = ints[0].shape[0]
    if any(t.shape != (n,) for t in ints) or ti.dim() != 2 or ti.shape[0] != n:
        raise ValueError(mismatch)
    if out is None:
        out = torch.empty_like(qc)
    elif out.shape != qc.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("out must be a contiguous fp32 tensor shaped like q")
    sk = None if sinks is None else sinks.float().contiguous()
    if sk is not None and sk.shape != (heads,):
        raise ValueError(f"sinks must have shape ({heads},)")
    num_pages, page_size, kv_heads, _ = k_pages.shape
    fn(
        qc.data_ptr(),
        n_rows,
        out.data_ptr(),
        heads,
        n,
        *(t.data_ptr() for t in ints),
        ti.data_ptr(),
        ti.shape[1],
        k_pages.data_ptr(),
        v_pages.data_ptr(),
        k_pages.dtype == torch.bfloat16,
        num_pages,
        page_size,
        kv_heads,
        d,
        scale,
        window or 0,
        0 if sk is None else sk.data_ptr(),
    )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """What `decode_attention` computes (rows = all), in plain torch: gather each query's visible
    keys from its pages, softmax over the logits (and the sink) in fp32. Returns [n, heads, d]."""
    n, heads, d = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    out = torch.empty(n, heads, d)
    for i in range(n):
        length = int(lens[i])
        first = 0 if window is None else max(0, length - window)
        pos = torch.arange(first, length)
        page = tables[i].long()[pos // page_size]
        k = k_pages[page, pos % page_size].float().repeat_interleave(heads // kv_heads, dim=1)
        v = v_pages[page, pos % page_size].float().repeat_interleave(heads // kv_heads, dim=1)
        logits = torch.einsum("hd,khd->hk", q[i].float(), k) * scale  # [heads, keys]
        if sinks is not None:
            logits = torch.cat([logits, sinks.float().view(heads, 1)], dim=1)
        probs = torch.softmax(logits, dim=1)[:, : pos.numel()]
        out[i] = torch.einsum("hk,khd->hd", probs, v)
    return out


# ---- prefill attention over the paged KV pool (native/dense/prefill_attention.h) --------------


def prefill_usable(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    """Whether `prefill_attention` takes these: as `attention_usable`, and a head dim that is a
    multiple of 16 (64, 128, 256, ...; the tile kernels' vectors)."""
    d = q.shape[-1] if q.dim() else 0
    return attention_usable(q, k_pages, v_pages) and d % 16 == 0 and 0 < d <= 1024


def prefill_isa() -> str:
    """The prefill tile kernel the configured pool runs ("avx512", "avx2", "emu512", "scalar");
    "" when the extension is not built or configure() was not called."""
    if _native is None or not _native.configured():
        return ""
    return str(_native.prefill_isa())


def prefill_small_rows(n: int | None) -> None:
    """Tiles of at most n query rows run the few-row prefill kernel (keys in its vector lanes),
    the others the tile kernel; None: the automatic choice (a tile whose rows fill at most half a
    vector). The results are the same bits either way (prefill_attention.h); for tests and
    benchmarks."""
    _native.prefill_small_rows(-1 if n is None else n)


def prefill_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of prompt chunks, reading K/V straight from the paged pool.

    Chunk i is q's rows [rows[i], rows[i] + lens[i]) of one sequence, at positions [pos[i],
    pos[i] + lens[i]); its keys (earlier ones and its own, already written) are in the pages of
    tables[i] [max_pages] int32. The query at position p sees keys j with p - window < j <= p;
    sinks [heads] adds one logit per head to the softmax denominator. q [N, heads, d] fp32;
    k_pages, v_pages [num_pages, page_size, kv_heads, d] (bf16 or fp32). A row's result does
    not depend on the other rows, the chunking or the thread count (prefill_attention.h).
    Returns ``out`` [N, heads, d] fp32 (new when not given; only the chunks' rows are written).
    Check `prefill_usable` first.
    """
    return _paged_call(
        _native.prefill_attention, q, k_pages, v_pages, (rows, lens, pos), tables, scale,
        window, sinks, out, "rows, lens, pos and tables must describe the same number of chunks",
    )  # fmt: skip


def prefill_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """What `prefill_attention` computes, in plain torch (fp32): each chunk's keys gathered from
    its pages, a masked softmax over the logits (and the sink). Returns [N, heads, d] with the
    chunks' rows filled (zeros elsewhere)."""
    heads = q.shape[1]
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    out = torch.zeros(q.shape)
    for i in range(rows.shape[0]):
        r0, n, p0 = int(rows[i]), int(lens[i]), int(pos[i])
        kpos = torch.arange(p0 + n)
        page = tables[i].long()[kpos // page_size]
        k = k_pages[page, kpos % page_size].float().repeat_interleave(heads // kv_heads, dim=1)
        v = v_pages[page, kpos % page_size].float().repeat_interleave(heads // kv_heads, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q[r0 : r0 + n].float(), k) * scale
        qpos = torch.arange(p0, p0 + n).unsqueeze(1)
        allowed = kpos.unsqueeze(0) <= qpos
        if window is not None:
            allowed &= kpos.unsqueeze(0) > qpos - window
        logits = logits.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(heads, 1, 1).expand(heads, n, 1)
            logits = torch.cat([logits, sink], dim=2)
        probs = torch.softmax(logits, dim=2)[..., : kpos.numel()]
        out[r0 : r0 + n] = torch.einsum("hqk,khd->qhd", probs, v)
    return out
