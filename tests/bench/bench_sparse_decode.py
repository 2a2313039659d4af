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
sparse attention reads a fixed number of rows) and the indexer's time against its bytes per
token (every index key read once) at the read rate measured here (a plain fp32 sum over 512 MiB,
the same threads), and against its multiply-adds at the fp32 matmul rate measured here.

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
TIMED = ("index_topk", "sparse_attention")
times: dict[str, list[float]] = defaultdict(list)
clock = time.perf_counter  # time.thread_time with --cpu-time


def _wrap() -> None:
    """Times every call of the native indexer and attention (module attributes: the layers call
    them through the module)."""
    for name in TIMED:
        fn = getattr(sparse_native, name)

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = clock()
            r = _fn(*a, **k)
            times[_name].append(clock() - t0)
            return r

        setattr(sparse_native, name, timed)


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


def glm5_cases(contexts: list[int], g: torch.Generator):
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
            keys = pool.read(0, st.pages, ctx + 1)[0][:, 0, layer.kvr + layer.dr :].float()
            ref_sel = ix.select(ix.queries(q_res, cos, sin), ix.weights(x), keys, ctx)
        native_sel = native_selection(layer, x, rope, cos, sin, pool, st, ctx)
        if not torch.equal(torch.sort(native_sel).values, torch.sort(ref_sel[0]).values):
            raise SystemExit(f"GLM-5 {ctx}: the native selection differs from the torch one")
        with torch_sparse():
            ref = call()
        _close(out, ref, f"GLM-5 {ctx}")
    bytes_per_key = cfg.index_head_dim * 2
    macs_per_key = cfg.index_n_heads * cfg.index_head_dim
    return desc, calls, bytes_per_key, macs_per_key


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


def v4_cases(contexts: list[int], g: torch.Generator, kind: str):
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
    calls = {}
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
    return desc, calls, (bytes_per_key if csa else 0), (macs_per_key if csa else 0)


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


def run(desc, calls, bytes_per_key, macs_per_key, reps, rate, fmas) -> None:
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
    print(f"{'context':>8} {'layer ms':>9} {'indexer ms':>11} {'attention ms':>13} "
          f"{'idx MB':>7} {'at read rate ms':>16} {'idx/read':>9} {'at fma rate ms':>15}")  # fmt: skip
    first = min(calls)
    att0 = statistics.median(parts[first, "sparse_attention"])
    for ctx in calls:
        tot = statistics.median(totals[ctx]) * 1e3
        idx = statistics.median(parts[ctx, "index_topk"]) * 1e3
        att = statistics.median(parts[ctx, "sparse_attention"]) * 1e3
        nbytes = ctx * bytes_per_key
        at_read = nbytes / rate * 1e3
        at_fma = ctx * macs_per_key / fmas * 1e3
        ratio = f"{idx / at_read:9.2f}" if idx and at_read else f"{'-':>9}"
        print(f"{ctx:>8} {tot:9.2f} {idx:11.3f} {att:13.3f} {nbytes / 1e6:7.2f} "
              f"{at_read:16.3f} {ratio} {at_fma:15.3f}")  # fmt: skip
    last = max(calls)
    att1 = statistics.median(parts[last, "sparse_attention"])
    print(f"attention flatness {last} vs {first}: {att1 / att0:.2f}x")


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
    rate, fmas = read_rate(), fma_rate()
    print(f"{'CPU time' if args.cpu_time else 'wall clock'}, {threads} threads, sparse kernels {sparse_native.isa()}; read rate "
          f"{rate / 1e9:.1f} GB/s (fp32 sum, 512 MiB); fp32 matmul {fmas / 1e9:.1f} G multiply-"
          f"adds/s")  # fmt: skip
    if args.only in (None, "glm5"):
        run(*glm5_cases([4096, 8192, 16384], g), args.reps, rate, fmas)
    if args.only in (None, "v4"):
        for kind in ("csa", "hca"):
            run(*v4_cases([2048, 8192, 16384], g, kind), args.reps, rate, fmas)
    print(
        "\nidx/read: the indexer's time over its bytes at the read rate; at fma rate: its "
        "multiply-adds (heads x dim a key) at the matmul rate (the bound when compute-limited)"
    )


if __name__ == "__main__":
    main()
