"""Micro-benchmark of the bf16-dot kernels (vdpbf16ps, isa "avx512bf16") against the fp32-FMA
kernels (isa "avx512") for bf16 weights, one thread. (Not collected by pytest.)

Rows: one routed expert of Qwen3-30B-A3B geometry (H = 2048, I = 768: gate, up and down, 9.4 MB
of bf16) through `ftnative`, and one 2048 x 2048 bf16 dense projection (8 MiB) through `ftdense`,
at T = 1 (decode) and T = --t (prefill). "dram": every call reads the next of a pool of weights
larger than the last-level cache; "hot": the same weights every call (L2/L3), which shows the
compute side. The two paths alternate rep by rep (interleaved) and medians over --reps reps of
--calls calls each are printed, in microseconds per call, with GB/s of weight bytes.

--cpu-time (for a shared, noisy machine): CPU time instead of the wall clock, so time the
scheduler gives to other processes is not counted (memory stalls still are): for dense calls the
calling thread's (it runs the whole job with one thread), for expert calls that of the executor's
worker (the process's CPU time less the calling thread's; the worker does not spin between calls).

Usage: python tests/bench/bench_bf16dot.py [--reps N] [--calls N] [--t T] [--pool-mib M]
       [--cpu-time]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from freetokend.experts.banks import ActivationSpec, ExpertBanks
from freetokend.experts.cpu_executor import CpuExecutor, supported_isas
from freetokend.native import dense_native

H, INTER, DENSE = 2048, 768, 2048
PATHS = ("avx512", "avx512bf16")


def expert_calls(isa: str, t: int, n_experts: int, banks: ExpertBanks) -> Callable[[int], object]:
    ex = CpuExecutor(banks, ActivationSpec(), threads=1, isa=isa, tile_min_tokens=12, spin_us=0)
    x = torch.randn(t, H)
    w = torch.ones(t, 1)
    ids = [torch.full((t, 1), e, dtype=torch.int32) for e in range(n_experts)]
    return lambda i: ex.forward(x, ids[i % n_experts], w)


def dense_calls(t: int, pool: torch.Tensor) -> Callable[[int], object]:
    m = pool.shape[0] // DENSE
    x = torch.randn(t, DENSE)
    ws = [pool[j * DENSE : (j + 1) * DENSE] for j in range(m)]
    return lambda i: dense_native.linear(x, ws[i % m])


def timed(call: Callable[[int], object], calls: int, start: int, clock: str) -> float:
    """Seconds per call by `clock`: "wall", "thread" (the caller's CPU time) or "worker" (the
    process's CPU time less the caller's)."""

    def now() -> float:
        if clock == "wall":
            return time.perf_counter()
        if clock == "thread":
            return time.thread_time()
        return time.process_time() - time.thread_time()

    t0 = now()
    for i in range(start, start + calls):
        call(i)
    return (now() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--t", type=int, default=64, help="prefill tokens")
    ap.add_argument("--pool-mib", type=int, default=384, help="weights cycled for 'dram' rows")
    ap.add_argument("--cpu-time", action="store_true", help="CPU time, not the wall clock")
    args = ap.parse_args()
    if "avx512bf16" not in supported_isas():
        raise SystemExit(f"this CPU lacks avx512bf16 (supports {supported_isas()})")
    torch.set_num_threads(1)
    expert_bytes = 3 * H * INTER * 2
    n_pool = max(2, args.pool_mib * 2**20 // expert_bytes)
    g = torch.Generator().manual_seed(0)
    banks = ExpertBanks(
        gate_up=(torch.randn(n_pool, 2 * INTER, H, generator=g) * 0.02).to(torch.bfloat16),
        down=(torch.randn(n_pool, H, INTER, generator=g) * 0.02).to(torch.bfloat16),
    )
    dense_pool = (torch.randn(args.pool_mib * 2**20 // (2 * DENSE), DENSE, generator=g) * 0.02).to(
        torch.bfloat16
    )
    dense_pool = dense_pool[: dense_pool.shape[0] // DENSE * DENSE]
    rows: list[tuple[str, int, str, int, dict[str, Callable[[int], object]]]] = []
    for t in (1, args.t):
        for where, n in (("dram", n_pool), ("hot", 1)):
            calls = {p: expert_calls(p, t, n, banks) for p in PATHS}
            rows.append(("expert", t, where, expert_bytes, calls))
        for where, pool in (("dram", dense_pool), ("hot", dense_pool[:DENSE])):
            rows.append(
                ("dense", t, where, DENSE * DENSE * 2, {p: dense_calls(t, pool) for p in PATHS})
            )
    times: dict[tuple[int, str], list[float]] = {}
    for r in range(-1, args.reps):  # one warm-up rep
        for ri, (kind, _t, _where, _nbytes, calls) in enumerate(rows):
            for p in PATHS if r % 2 else PATHS[::-1]:
                if kind == "dense":
                    dense_native.configure(1, isa=p)
                clock = "wall" if not args.cpu_time else "thread" if kind == "dense" else "worker"
                dt = timed(calls[p], args.calls, r * args.calls, clock)
                if r >= 0:
                    times.setdefault((ri, p), []).append(dt)
    print(
        f"bf16 weights, 1 thread, {'CPU' if args.cpu_time else 'wall'} time, medians of "
        f"{args.reps} interleaved reps x {args.calls} calls"
    )
    print(
        f"{'':6s} {'T':>3s} {'weights':7s} {'fp32-FMA us':>11s} {'GB/s':>5s} "
        f"{'bf16-dot us':>11s} {'GB/s':>5s} {'speed-up':>8s}"
    )
    for ri, (kind, t, where, nbytes, _calls) in enumerate(rows):
        a, b = (statistics.median(times[ri, p]) for p in PATHS)
        print(
            f"{kind:6s} {t:3d} {where:7s} {a * 1e6:11.1f} {nbytes / a / 1e9:5.1f} "
            f"{b * 1e6:11.1f} {nbytes / b / 1e9:5.1f} {a / b:7.2f}x"
        )


if __name__ == "__main__":
    main()
