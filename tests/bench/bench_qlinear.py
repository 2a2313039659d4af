"""Micro-benchmark of the dense integer-dot projections (ftdense.qlinear) against the bf16 native
projection, at decode (T = 1; --t for more tokens): is each weight format's kernel memory-bound?
(Not collected by pytest.)

Each format gets a weight pool of about --gib GiB (beyond the last-level cache) built by tiling
256 rows quantised from random values (the kernels' speed does not depend on the values); every
call projects one token through the next N x K slice of its pool, cycling, so the weights come
from DRAM. The formats are interleaved call by call over the rounds and medians reported, so a
busy machine slows them alike. Printed per format: median time per call, GB/s of weight bytes
read (the GGUF blocks as stored, scales included), that rate over a plain memory read (an fp32
sum over the bf16 pool with the same threads, median of its rounds), and time per call relative
to bf16: the figure decode speed follows. On a shared machine, --cpu-time (one thread) times the
calling thread's CPU time instead of the wall clock, so time the scheduler gives to other
processes is not counted (memory stalls still are).

Usage: python tests/bench/bench_qlinear.py [--threads N] [--rounds N] [--gib G] [--n N] [--k K]
       [--t T] [--formats q4_k,q6_k,...] [--isa vnni|avx2|scalar] [--cpu-time]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from freetokend.formats import gguf_blocks
from freetokend.native import dense_native
from freetokend.native import qlinear_native as ql

GB = 1e9


def bf16_call(x: torch.Tensor, n: int, k: int, gib: float) -> tuple[Callable[[int], object], int]:
    """-> (call i, weight bytes per call); the pool stays alive in the closure."""
    rows = max(n, int(gib * 2**30) // (2 * k) // n * n)
    pool = torch.empty(rows, k, dtype=torch.bfloat16).uniform_(-0.03, 0.03)
    m = rows // n
    return lambda i: dense_native.linear(x, pool[(i % m) * n : (i % m + 1) * n]), n * k * 2


def quant_call(
    fmt: str, x: torch.Tensor, n: int, k: int, gib: float, isa: str
) -> tuple[Callable[[int], object], int]:
    rb = gguf_blocks.row_bytes(fmt, k)
    rows = max(n, int(gib * 2**30) // rb // n * n)
    tile = gguf_blocks.quantize(torch.randn(256, k) * 0.02, fmt)
    pool = tile.repeat(rows // 256 + 1, 1)[:rows].contiguous()
    ws = [ql.QuantWeight.from_raw(pool[j * n : (j + 1) * n], fmt, k) for j in range(rows // n)]
    return lambda i: ql.qlinear(x, ws[i % len(ws)], isa=isa), n * rb


def memory_read(gib: float, clock: Callable[[], float]) -> Callable[[], float]:
    """-> a function giving the GB/s of one fp32 sum over a pool of ``gib`` GiB."""
    flat = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32).uniform_()

    def once() -> float:
        t0 = clock()
        flat.sum()
        return flat.numel() * 4 / (clock() - t0) / GB

    return once


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="pool threads (0: torch's count)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--gib", type=float, default=0.75, help="weight pool size per format")
    ap.add_argument("--n", type=int, default=4096, help="output rows per call")
    ap.add_argument("--k", type=int, default=4096, help="inputs per row")
    ap.add_argument("--t", type=int, default=1, help="tokens per call")
    ap.add_argument("--formats", default=",".join(gguf_blocks.QTYPE_CODES))
    ap.add_argument("--isa", default="", help="qdot path (default: the best this CPU runs)")
    ap.add_argument("--cpu-time", action="store_true", help="thread CPU time (needs --threads 1)")
    a = ap.parse_args()
    threads = a.threads or torch.get_num_threads()
    if a.cpu_time and threads != 1:
        ap.error("--cpu-time times the calling thread: give --threads 1")
    clock = time.thread_time if a.cpu_time else time.perf_counter
    torch.set_num_threads(threads)
    dense_native.configure(threads)
    isa = a.isa or ql.isas()[0]
    x = torch.randn(a.t, a.k)
    calls = {"bf16": bf16_call(x, a.n, a.k, a.gib)}
    for fmt in a.formats.split(","):
        calls[fmt] = quant_call(fmt, x, a.n, a.k, a.gib, isa)
    read_once = memory_read(a.gib, clock)
    times: dict[str, list[float]] = {name: [] for name in calls}
    reads = []
    for r in range(-3, a.rounds):  # 3 warm-up rounds
        for name, (fn, _) in calls.items():
            t0 = clock()
            fn(r)
            if r >= 0:
                times[name].append(clock() - t0)
        if r % 20 == 0:
            reads.append(read_once())
    read = statistics.median(reads)
    print(
        f"T = {a.t}, W [{a.n}, {a.k}], {threads} threads, qdot isa {isa}, pool {a.gib} GiB/format, "
    )
    what = "thread CPU time" if a.cpu_time else "wall clock"
    print(f"{a.rounds} interleaved rounds, {what}; memory read (fp32 sum): {read:.1f} GB/s")
    print(f"{'format':>6} {'bits/w':>6} {'us/call':>8} {'GB/s':>6} {'of read':>7} {'vs bf16':>8}")
    sec16 = statistics.median(times["bf16"])
    for name, (_, nbytes) in calls.items():
        sec = statistics.median(times[name])
        gbs = nbytes / sec / GB
        print(
            f"{name:>6} {8 * nbytes / (a.n * a.k):6.2f} {sec * 1e6:8.1f} {gbs:6.1f} "
            f"{gbs / read:6.0%} {sec / sec16:7.2f}x"
        )


if __name__ == "__main__":
    main()
