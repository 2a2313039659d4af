"""Prefill attention of one layer on the CPU: the native tiled kernel against the torch path.

    PYTHONPATH=/tmp/ftpath .venv/bin/python tests/bench/bench_prefill_attention.py \
        [--contexts 2048 8192 32768] [--heads 32 --kv-heads 4 --head-dim 128] [--threads 2]

One attention layer (default Qwen3-30B-A3B's: 32 query heads on 4 KV heads of dim 128) over a
bf16 paged pool (pages of 16), a prompt of each context length prefilled in chunks of 512 (the
scheduler's max_step_tokens), through `attention.paged_attention` with the native prefill on
and off (the torch path: pages gathered, fp32, SDPA in query blocks). Each chunk's K/V are
written first, as the model does. Engines interleaved per repeat, medians printed with their
GFLOP/s (4 * heads * d flops per visible (query, key) pair), and the process's CPU time (all
threads; on a shared machine the wall time includes the waits for a core). Contexts above --full (default
8192) time a sample of --sample chunks spread over the prompt (the time of a chunk grows
linearly with its position) and scale it to the whole prompt: the line says "est.". Each chunk's
outputs of the two paths are checked to agree (max abs difference printed).

--rows 1 2 4 8: the few-row mode instead (issue 44: a short prompt chunk beside decode streams):
one chunk of n rows at the end of each context, straight through `dense_native.prefill_attention`
(--repeats x --calls calls per row count): the tile kernel for every tile (`prefill_small_rows(0)`),
the few-row kernel for every tile ("few") and the automatic choice, interleaved call by call,
their outputs checked to be the same bits; median milliseconds per call (one layer). A build
without the few-row kernel times the tile kernel alone. --isa forces the kernels' ISA.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from freetokend.kv.pool import KVPool
from freetokend.kv.seq_state import SeqState
from freetokend.models.batch import ForwardBatch, SeqChunk
from freetokend.models.layers import attention as attn
from freetokend.native import dense_native

CHUNK = 512


def _batch(pool: KVPool, st: SeqState, pos: int, n: int) -> ForwardBatch:
    return ForwardBatch(
        token_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.arange(pos, pos + n),
        chunks=[SeqChunk(0, n, pos, st)],
        kv=pool,
        moe=None,  # type: ignore[arg-type]
        logits_rows=torch.zeros(0, dtype=torch.long),
    )


def few_rows(args: argparse.Namespace, g: torch.Generator) -> None:
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    small = getattr(dense_native, "prefill_small_rows", None)
    try:
        small and small(None)
    except AttributeError:  # an extension built before the few-row kernel
        small = None
    kinds = ("tile", "few", "auto") if small else ("tile",)
    cut = {"tile": 0, "few": 1 << 20, "auto": None}
    for ctx in args.contexts:
        pages = -(-ctx // 16) + 1
        k, v = (torch.randn(pages, 16, kvh, d, generator=g).bfloat16() for _ in range(2))
        tables = torch.randperm(pages, generator=g).int()[None]
        q = torch.randn(max(args.rows), h, d, generator=g)
        line = []
        for n in args.rows:
            rows = (torch.tensor([x], dtype=torch.int32) for x in (0, n, ctx - n))
            a = (q[:n], k, v, tables, *rows)
            times: dict[str, list[float]] = {x: [] for x in kinds}
            outs = {}
            for _ in range(args.repeats * args.calls):
                for kind in kinds:
                    if small:
                        small(cut[kind])
                    t0 = time.perf_counter()
                    outs[kind] = dense_native.prefill_attention(*a, d**-0.5)
                    times[kind].append(time.perf_counter() - t0)
            if small:
                small(None)
                assert all(torch.equal(outs[x], outs["tile"]) for x in kinds), n
            line.append(f"{n} rows " + " / ".join(
                f"{x} {1e3 * statistics.median(times[x]):.2f}" for x in kinds
            ))  # fmt: skip
        print(f"context {ctx}: ms a call: " + ";  ".join(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--full", type=int, default=8192, help="longest context timed in full")
    ap.add_argument("--sample", type=int, default=4, help="chunks timed above --full")
    ap.add_argument("--rows", type=int, nargs="*", default=[], help="the few-row mode")
    ap.add_argument("--calls", type=int, default=20, help="calls a round (--rows)")
    ap.add_argument("--isa", default=None, help="force the ISA (avx512, avx2, emu512, scalar)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dense_native.configure(args.threads, isa=args.isa)
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    print(f"threads {args.threads}, prefill kernel {dense_native.prefill_isa()}, "
          f"{h} heads / {kvh} KV heads, d {d}, chunks of {CHUNK}")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    if args.rows:
        few_rows(args, g)
        return
    for ctx in args.contexts:
        pool = KVPool(1, -(-ctx // 16) + 1, 16, kvh, d, torch.bfloat16)
        st = SeqState(pages=pool.alloc(pool.pages_for(ctx))[::-1])  # scattered (reversed)
        starts = list(range(0, ctx, CHUNK))
        k = torch.randn(ctx, kvh, d, generator=g)
        v = torch.randn(ctx, kvh, d, generator=g)
        q = torch.randn(ctx, h, d, generator=g)
        pool.write(0, st.pages, 0, k, v)
        timed = starts
        if ctx > args.full:
            step = len(starts) / args.sample
            timed = [starts[int((i + 0.5) * step)] for i in range(args.sample)]
        pairs = sum(min(CHUNK, ctx - s) * (s + (min(CHUNK, ctx - s) + 1) / 2) for s in starts)
        flops = 4 * h * d * pairs
        times: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        diff = 0.0
        for _ in range(args.repeats):
            outs = {}
            for native in (False, True):
                attn.native_prefill = native
                total, c0 = 0.0, time.process_time()
                for s in timed:
                    n = min(CHUNK, ctx - s)
                    b = _batch(pool, st, s, n)
                    qc = q[s : s + n].contiguous()
                    kv = (k[s : s + n], v[s : s + n])
                    t0 = time.perf_counter()
                    out = attn.paged_attention(b, 0, qc, kv, d**-0.5, None)
                    total += time.perf_counter() - t0
                    if s == timed[-1]:
                        outs[native] = out
                times[native].append(total * len(starts) / len(timed))
                cpu[native].append((time.process_time() - c0) * len(starts) / len(timed))
            diff = max(diff, float((outs[True] - outs[False]).abs().max()))
        attn.native_prefill = True
        old, new = (statistics.median(times[x]) for x in (False, True))
        cold, cnew = (statistics.median(cpu[x]) for x in (False, True))
        est = " est." if len(timed) < len(starts) else ""
        print(f"context {ctx:6d}: torch {old:8.2f} s ({flops / old / 1e9:5.1f} GFLOP/s)  "
              f"native {new:8.2f} s ({flops / new / 1e9:5.1f} GFLOP/s)  {old / new:4.2f}x{est}  "
              f"max |diff| {diff:.1e}  cpu time {cold:.2f} / {cnew:.2f} s  (repeats {[round(t, 2) for t in times[False]]} / "
              f"{[round(t, 2) for t in times[True]]})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
