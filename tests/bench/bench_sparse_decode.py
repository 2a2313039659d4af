"""Sparse decode attention at real widths: the Lightning Indexer's and the attention's time per
decode token against the context length (issues 42 and 43). (Not collected by pytest.)

Two attention layers with random bf16 weights at the released geometry, read from transformers'
config defaults:

* GLM-5 (`GlmMoeDsaConfig`, the DSA of `glm_moe_dsa`): 64 heads, MLA latent 512 + rope 64, an
  indexer of 32 heads x 128 with index_topk 2048; one `SparseMLAttention` over a bf16 KV pool
  holding 4k / 8k / 16k tokens of context.
* DeepSeek-V4-Flash (`DeepseekV4Config`): 64 heads of 512 on one shared KV head, window 128, a
  CSA layer (rate 4; indexer 64 heads x 128, index_topk 512) and an HCA layer (rate 128), with
  2k / 8k / 16k tokens of context.

The context is not prefilled through the model (16k tokens of prefill at these widths take
minutes on a small machine): the pool rows (latents, rotated keys, index keys: unit normal, as
the LayerNorm'd / RMSNorm'd rows are) and V4's state (the window's keys, the compressed entries,
the open compressor windows' overlap) are written directly with random values. Each timed call
is one decode token through the layer's own `forward` (native path: `sparse_native`), the
indexer's and the attention's calls timed apart by wrapping them; the layer total includes the
projections (and for DSA the absorbed q / output per-head products, for V4 the compressors).
Contexts alternate rep by rep; medians over --reps.

Checked before timing, at every context: the native selection equals the torch reference's
(`LightningIndexer.select` / `Indexer.scores` + `select_topk`) and the layer's output equals the
torch path's (the layer with `sparse_native` off: the same projections) within 1e-3 relative
(the attention outputs agree to fp32 rounding, but the output projections round their input to
bf16, the native dense kernels' contract, and a last-bit difference flips some of those
roundings: observed 1e-5 to 2e-4).

Reported: the attention's flatness (its time at the largest context over the smallest: the
sparse attention reads a fixed number of rows); the native indexer's time (scoring every key +
the top-k) against its keys' bytes at the read rate measured here (a plain fp32 sum over 512
MiB, the same threads: "keys/read", the issues' target of 1.5x) and its multiply-adds a second;
the indexer's projections (its q from the q latent, its head weights, its key projection (DSA)
or its compressor (V4)) and its full time (projections + scoring + top-k) against its full
bytes a token (those weights + the keys) at the read rate; and the physical floor of keys/read
on this CPU: a key byte costs heads x dim / (dim x bytes an element) multiply-adds (16 for both
models: 32 heads on bf16 keys, 64 on fp32 entries), so no fp32 scoring gets below 16 x read
rate / the core's FMA peak (register-only FMA chains, `sparse_native.fma_probe`).

Measured (AMD EPYC Zen 3, 2 cores, AVX2; shared with 6 other jobs, load 14-25: figures +-30%
run to run; --threads 1 --cpu-time --reps 7; the old kernel run by the script's previous version
right after, so the pair is back to back; its layer times (62-68 ms against 52-53 for GLM-5)
show it had more contention):

                          old kernel                     new kernel (index_impl.h)
    GLM-5     context  score+topk  keys/read  GMAC/s    score+topk  keys/read  GMAC/s
              4096     2.09 ms     22.2        8.0      1.53 ms     13.3       11.0
              8192     3.96 ms     21.1        8.5      2.68 ms     11.6       12.5
              16384    6.70 ms     17.8       10.0      4.33 ms      9.4       15.5
    V4 CSA    8192     1.51 ms     16.1       11.1      1.08 ms      9.4       15.6
              16384    2.49 ms     13.3       13.5      1.84 ms      8.0       18.2
    (read rate 11.1 GB/s in the old run, 9.1 in the new: keys/read moves with it. An earlier
    pair, before the prefetches were spread, at lower load: GLM-5 16k 5.84 -> 5.02 ms, V4 16k
    2.03 -> 2.09 ms.)

    new run: FMA peak 36.8 G multiply-adds/s a core (44-45 in quieter minutes); keys-only floor
    16 x 9.1 / 36.8 = 4.0x (4.6-4.7x in other runs); GLM-5 full indexer (projections 2.2-2.7
    ms, 20.2-23.3 MB a token): 4.0 / 5.4 / 6.5 ms, full/read 1.8 / 2.3 / 2.6x at 4k / 8k / 16k;
    V4 CSA full (22.6-23.6 MB): 3.3 / 3.8 ms, full/read 1.3 / 1.5x at 8k / 16k (at 2k the
    entries are within index_topk: no scoring). The attention: flat within 1.01x (GLM-5) and
    1.15x (V4 CSA) from the smallest context to 16k.

So the keys-only target (1.5x) is out of reach on this CPU for any fp32 scoring of fp32 / bf16
keys: the floor is 4.0-4.7x (it scales with read rate / FMA peak; two threads were not measured:
the machine was busy). Counting the indexer's weights, which a token reads too, V4's full indexer
is within 1.5x at 8k and 16k, GLM-5's at 1.8-2.6x. The new kernel reaches the core's FMA peak on a
packed tile (41-45 G multiply-adds/s) and about 25-33 on contiguous bf16 keys in a loop, but in
this benchmark 11-18: the keys come from DRAM (the layer's 50 ms of weight reads between two decode
steps evict them), GLM-5's as 256-byte slices of 1408-byte pool rows; perf on that layout alone
showed the prefetches stalling (now spread over the tile's head blocks) and the FMAs waiting on the
packed tile: it is bound by reading strided keys, not by arithmetic. What would move it: the index
keys in a pool region of their own (contiguous, streamed at the read rate), and fewer bytes and
multiply-adds a key (int8 / FP8 keys with block scales, as DeepSeek's release stores them: maddubs
on AVX2, VNNI on AVX-512). Quantized keys do not help the ratio itself (the bytes shrink with the
work) and change the scores, so the selections would no longer equal the fp32 reference's: left
out.

--cpu-time (for a shared, noisy machine; with --threads 1): the calling thread's CPU time instead
of the wall clock for every figure (read and matmul rates included), so time the scheduler gives
to other processes is not counted; memory stalls still are. With one thread the pool runs every
task on the calling thread.

Usage: python tests/bench/bench_sparse_decode.py [--reps N] [--threads T] [--only glm5|v4]
       [--cpu-time]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import transformers as tf

from freetokend.kv.pool import KVPool
from freetokend.kv.seq_state import SeqState
from freetokend.models.batch import ForwardBatch, SeqChunk
from freetokend.models.config_hf import from_dict
from freetokend.models.deepseek_v4_model import v4_config
from freetokend.models.layers.compressed import CompressorState, index_scores, select_topk
from freetokend.models.layers.dsa import SparseMLAttention
from freetokend.models.layers.rope import Rope
from freetokend.models.layers.v4_attention import IndexerShape, V4Attention, V4AttentionState
from freetokend.native import dense_native, sparse_native

PAGE = 64
# the native indexer (scoring + top-k), the attention, the indexer's projections (timed by
# wrapping the indexer's own callables: _time_projections)
TIMED = ("index_topk", "sparse_attention", "index_proj")
times: dict[str, list[float]] = defaultdict(list)
clock = time.perf_counter  # time.thread_time with --cpu-time


def _timed(fn: Callable, name: str) -> Callable:
    def timed(*a, **k):
        t0 = clock()
        r = fn(*a, **k)
        times[name].append(clock() - t0)
        return r

    return timed


def _wrap() -> None:
    """Times every call of the native indexer and attention (module attributes: the layers call
    them through the module)."""
    for name in TIMED[:2]:
        setattr(sparse_native, name, _timed(getattr(sparse_native, name), name))


def _time_calls(obj: object, names: tuple[str, ...]) -> None:
    """Times ``obj``'s callables ``names`` as the indexer's projections (instance attributes: a
    module's ``__call__`` finds a ``forward`` set on the instance)."""
    for n in names:
        setattr(obj, n, _timed(getattr(obj, n), "index_proj"))


def _bytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _randomize(m: torch.nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("sinks") or "bias" in name:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def read_rate() -> float:
    """Bytes per second of a plain read: torch's fp32 sum over 512 MiB (out of cache)."""
    x = torch.ones(128 << 20)
    x.sum()
    ts = []
    for _ in range(7):
        t0 = clock()
        x.sum()
        ts.append(clock() - t0)
    return x.numel() * 4 / statistics.median(ts)


def fma_rate() -> float:
    """fp32 multiply-adds per second of torch's matmul (1024 x 1024 x 1024)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    ts = []
    for _ in range(7):
        t0 = clock()
        a @ b
        ts.append(clock() - t0)
    return 1024**3 / statistics.median(ts)


def fma_peak() -> float:
    """fp32 multiply-adds per second of one core: independent FMA chains in registers
    (`sparse_native.fma_probe`), the bound of any fp32 scoring on this CPU."""
    iters = 1 << 22
    sparse_native.fma_probe(iters)
    ts = []
    for _ in range(7):
        t0 = clock()
        macs = sparse_native.fma_probe(iters)
        ts.append(clock() - t0)
    return macs / statistics.median(ts)


@contextmanager
def torch_sparse() -> Iterator[None]:
    """The layers' torch decode path for the attention and the indexer alone (the projections
    stay native, so the comparison isolates the sparse part)."""
    usable = sparse_native.usable
    sparse_native.usable = lambda *t: False  # type: ignore[assignment]
    try:
        yield
    finally:
        sparse_native.usable = usable  # type: ignore[assignment]


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = ((a - b).norm() / b.norm()).item()
    if err > 1e-3:
        raise SystemExit(f"{what}: native and torch outputs differ (relative {err:.2e})")
    print(f"  {what}: output within {err:.1e} (relative) of the torch path")


# ---- GLM-5 ------------------------------------------------------------------------------------


# (description, decode call per context, key bytes and multiply-adds a token of context, the
# indexer's weight bytes)
Case = tuple[str, dict[int, Callable[[], torch.Tensor]], float, float, int]


def glm5_cases(contexts: list[int], g: torch.Generator) -> Case:
    raw = {**tf.GlmMoeDsaConfig().to_dict(), "architectures": ["GlmMoeDsaForCausalLM"]}
    cfg = from_dict(raw)
    layer = SparseMLAttention(cfg, 0, 0, torch.bfloat16).eval()
    _randomize(layer, g)
    ix = layer.indexer
    assert ix is not None
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
    top = max(contexts) + 1
    pages = -(-top // PAGE)
    pool = KVPool(1, pages, PAGE, 1, width, torch.bfloat16)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    rope = Rope(cfg.rope)
    desc = (
        f"GLM-5 geometry: hidden {cfg.hidden_size}, {cfg.num_heads} heads, latent "
        f"{cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}, indexer {cfg.index_n_heads} x "
        f"{cfg.index_head_dim}, index_topk {cfg.index_topk}; bf16 pool"
    )
    x = torch.randn(1, cfg.hidden_size, generator=g)
    calls: dict[int, Callable[[], torch.Tensor]] = {}
    for ctx in contexts:
        st = SeqState(pages=list(range(pages)), num_tokens=ctx)
        pos = torch.tensor([ctx])
        cos, sin = rope.cos_sin(pos)

        def call(st=st, pos=pos, cos=cos, sin=sin, ctx=ctx) -> torch.Tensor:
            batch = ForwardBatch(pos, pos, [SeqChunk(0, 1, ctx, st)], pool, None, pos)  # type: ignore[arg-type]
            with torch.no_grad():
                return layer(x, batch, rope, cos, sin)

        calls[ctx] = call
        # the check: the native selection and output against the torch path's
        out = call()
        with torch.no_grad():
            q, packed, q_res = layer.project(x, rope, cos, sin)
            assert q_res is not None
            keys = pool.read(0, st.pages, ctx + 1)[0][:, 0, layer.kvr + layer.dr :].float()
            ref_sel = ix.select(ix.queries(q_res, cos, sin), ix.weights(x), keys, ctx)
        native_sel = native_selection(layer, x, rope, cos, sin, pool, st, ctx)
        if not torch.equal(torch.sort(native_sel).values, torch.sort(ref_sel[0]).values):
            raise SystemExit(f"GLM-5 {ctx}: the native selection differs from the torch one")
        with torch_sparse():
            ref = call()
        _close(out, ref, f"GLM-5 {ctx}")
    _time_calls(ix, ("keys", "queries", "weights"))
    bytes_per_key = cfg.index_head_dim * 2
    macs_per_key = cfg.index_n_heads * cfg.index_head_dim
    return desc, calls, bytes_per_key, macs_per_key, _bytes(ix)


def native_selection(layer, x, rope, cos, sin, pool, st, ctx) -> torch.Tensor:
    ix = layer.indexer
    with torch.no_grad():
        _, _, q_res = layer.project(x, rope, cos, sin)
        iq, iw = ix.queries(q_res, cos, sin), ix.weights(x)
    t32 = torch.tensor(st.pages, dtype=torch.int32)
    return layer._select_native(iq[0], iw[0], pool.k[0], t32, ctx + 1)[0]


# ---- DeepSeek-V4-Flash ---------------------------------------------------------------------


def _compressor_state(rate: int, dim: int, entries: int, overlap: bool, g) -> CompressorState:
    width = 2 * dim if overlap else dim
    z = torch.zeros(0, width)
    prev = (torch.randn(rate, dim, generator=g), torch.randn(rate, dim, generator=g))
    return CompressorState(rate, torch.randn(entries, dim, generator=g), z, z.clone(),
                           *(prev if overlap else (None, None)))  # fmt: skip


def v4_cases(contexts: list[int], g: torch.Generator, kind: str) -> Case:
    raw = {**tf.DeepseekV4Config().to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}
    cfg = v4_config(raw)
    csa = kind == "csa"
    rate = cfg.compress_rates[cfg.layer_types.index(
        "compressed_sparse_attention" if csa else "heavily_compressed_attention"
    )]  # fmt: skip
    index = IndexerShape(cfg.index_heads, cfg.index_head_dim, cfg.index_topk) if csa else None
    layer = V4Attention(
        hidden=cfg.hidden_size, heads=cfg.num_heads, head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        window=cfg.sliding_window, eps=cfg.rms_norm_eps, dtype=torch.bfloat16,
        compress_rate=rate, indexer=index,
    ).eval()  # fmt: skip
    _randomize(layer, g)
    rope = Rope(cfg.rope_compress)
    desc = (
        f"DeepSeek-V4-Flash geometry, {kind.upper()} layer (rate {rate}): hidden "
        f"{cfg.hidden_size}, {cfg.num_heads} heads x {cfg.head_dim} on one KV head, window "
        f"{cfg.sliding_window}"
        + (f", indexer {cfg.index_heads} x {cfg.index_head_dim}, index_topk {cfg.index_topk}"
           if csa else "")
        + "; fp32 state"
    )  # fmt: skip
    x = torch.randn(1, cfg.hidden_size, generator=g)
    calls: dict[int, Callable[[], torch.Tensor]] = {}
    for ctx in contexts:
        assert ctx % rate == 0
        st = V4AttentionState(
            torch.randn(cfg.sliding_window - 1, cfg.head_dim, generator=g),
            _compressor_state(rate, cfg.head_dim, ctx // rate, csa, g),
            _compressor_state(rate, cfg.index_head_dim, ctx // rate, True, g) if csa else None,
        )
        cos, sin = rope.cos_sin(torch.tensor([ctx]))

        def call(st=st, cos=cos, sin=sin, ctx=ctx) -> torch.Tensor:
            with torch.no_grad():
                return layer(x, ctx, st, rope, cos, sin)[0]

        calls[ctx] = call
        out = call()
        if csa and ctx // rate > cfg.index_topk:
            check_v4_selection(layer, x, ctx, st, rope, cos, sin)
        with torch_sparse():
            ref = call()
        _close(out, ref, f"V4 {kind} {ctx}")
    bytes_per_key = cfg.index_head_dim * 4 / rate  # per token of context: one entry per rate
    macs_per_key = cfg.index_heads * cfg.index_head_dim / rate
    if not csa:
        return desc, calls, 0, 0, 0
    ix = layer.indexer
    assert ix is not None
    for m in (ix.compressor, ix.q_b_proj, ix.weights_proj):
        _time_calls(m, ("forward",))
    return desc, calls, bytes_per_key, macs_per_key, _bytes(ix)


def check_v4_selection(layer, x, ctx, st, rope, cos, sin) -> None:
    ix = layer.indexer
    with torch.no_grad():
        q_res = layer.q_a_norm(layer.q_a_proj(x))
        new = ix.compressor(x, st.indexer, rope)
        ref = select_topk(ix.scores(x, q_res, torch.tensor([ctx]), new.entries, cos, sin), ix.topk)[
            0
        ]
        from freetokend.models.layers.compressed import rotate_tail

        iq = rotate_tail(ix.q_b_proj(q_res).view(1, ix.heads, ix.dim), cos, sin)[0]
        iw = ix.weights_proj(x)[0] * ix.heads**-0.5
        seen = (ctx + 1) // ix.rate
        sel, scores = sparse_native.index_topk(
            iq, iw, sparse_native.Rows(new.entries), seen, ix.topk, ix.dim**-0.5
        )
        want = index_scores(iq[None], new.entries[:seen], ix.weights_proj(x))[0]
        torch.testing.assert_close(scores, want, rtol=1e-4, atol=1e-4)
    if not torch.equal(sel.sort().values, ref.sort().values):
        raise SystemExit(f"V4 {ctx}: the native selection differs from the torch one")


# ---- timing and the report -----------------------------------------------------------------


def run(desc, calls, bytes_per_key, macs_per_key, weight_bytes, reps, rate, peak) -> None:
    totals: dict[int, list[float]] = defaultdict(list)
    parts: dict[tuple[int, str], list[float]] = defaultdict(list)
    for _ in range(reps):
        for ctx, call in calls.items():  # contexts interleaved
            for name in TIMED:
                del times[name][:]
            t0 = clock()
            call()
            totals[ctx].append(clock() - t0)
            for name in TIMED:
                parts[ctx, name].append(sum(times[name]))
    print(f"\n{desc}")
    print(f"{'context':>8} {'layer ms':>9} {'attn ms':>8} | {'score+topk ms':>13} {'keys MB':>8} "
          f"{'at read ms':>10} {'keys/read':>9} {'GMAC/s':>7} | {'proj ms':>8} {'full ms':>8} "
          f"{'full MB':>8} {'full/read':>9}")  # fmt: skip
    first = min(calls)
    att0 = statistics.median(parts[first, "sparse_attention"])
    for ctx in calls:
        tot = statistics.median(totals[ctx]) * 1e3
        idx = statistics.median(parts[ctx, "index_topk"]) * 1e3
        att = statistics.median(parts[ctx, "sparse_attention"]) * 1e3
        proj = statistics.median(parts[ctx, "index_proj"]) * 1e3
        nbytes = ctx * bytes_per_key
        at_read = nbytes / rate * 1e3
        full_bytes = nbytes + weight_bytes
        if idx and at_read:  # the indexer ran (V4: more entries than index_topk)
            ratio = f"{idx / at_read:9.2f}"
            gmacs = f"{ctx * macs_per_key / idx / 1e6:7.1f}"
            full_ratio = f"{(idx + proj) / (full_bytes / rate * 1e3):9.2f}"
        else:
            ratio, gmacs, full_ratio = f"{'-':>9}", f"{'-':>7}", f"{'-':>9}"
        print(f"{ctx:>8} {tot:9.2f} {att:8.3f} | {idx:13.3f} {nbytes / 1e6:8.2f} {at_read:10.3f} "
              f"{ratio} {gmacs} | {proj:8.3f} {idx + proj:8.3f} {full_bytes / 1e6:8.2f} "
              f"{full_ratio}")  # fmt: skip
    last = max(calls)
    att1 = statistics.median(parts[last, "sparse_attention"])
    print(f"attention flatness {last} vs {first}: {att1 / att0:.2f}x")
    if bytes_per_key:
        mac_per_byte = macs_per_key / bytes_per_key
        print(f"keys-only floor on this CPU: {mac_per_byte:.0f} MAC a key byte x "
              f"{rate / 1e9:.1f} GB/s / {peak / 1e9:.1f} G MAC/s peak = "
              f"{mac_per_byte * rate / peak:.2f}x (the least keys/read any fp32 scoring of "
              f"these keys reaches here)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="pool threads (default: torch's)")
    ap.add_argument("--only", choices=("glm5", "v4"), default=None)
    ap.add_argument("--cpu-time", action="store_true", help="CPU time (with --threads 1)")
    args = ap.parse_args()
    global clock
    if args.cpu_time:
        if args.threads != 1:
            raise SystemExit("--cpu-time counts the calling thread alone: pass --threads 1")
        clock = time.thread_time
    if not dense_native.available():
        raise SystemExit("ftdense is not built")
    threads = args.threads or torch.get_num_threads()
    dense_native.configure(threads)
    torch.set_num_threads(threads)
    _wrap()
    g = torch.Generator().manual_seed(0)
    rate, fmas, peak = read_rate(), fma_rate(), fma_peak() * threads
    print(f"{'CPU time' if args.cpu_time else 'wall clock'}, {threads} threads, sparse attention "
          f"{sparse_native.isa()}, indexer {sparse_native.index_isa()}; read rate "
          f"{rate / 1e9:.1f} GB/s (fp32 sum, 512 MiB); fp32 FMA peak {peak / 1e9:.1f} G "
          f"multiply-adds/s (register-only FMA chains x {threads} threads); fp32 matmul "
          f"{fmas / 1e9:.1f} G multiply-adds/s")  # fmt: skip
    if args.only in (None, "glm5"):
        run(*glm5_cases([4096, 8192, 16384], g), args.reps, rate, peak)
    if args.only in (None, "v4"):
        for kind in ("csa", "hca"):
            run(*v4_cases([2048, 8192, 16384], g, kind), args.reps, rate, peak)
    print(
        "\nscore+topk: the native index_topk (scoring every key + the top-k); keys/read: that "
        "over the keys' bytes at the read rate (the issues' target: within 1.5x); GMAC/s: its "
        "multiply-adds (heads x dim a key) a second; proj: the indexer's projections (its q, "
        "head weights, key / compressor); full: projections + scoring + top-k, against the "
        "indexer's weights + keys at the read rate"
    )


if __name__ == "__main__":
    main()
