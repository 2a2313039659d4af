"""Micro-benchmark of the native CPU expert executor (not collected by pytest).

Qwen3-30B-A3B expert geometry, one MoE layer: H = 2048, I = 768, 128 experts, top-8, bf16
(1.21 GB of expert weights). Prints, in one run:
  - plain memory read: numpy sum (1 thread) and torch sum (all threads) over the bank bytes
  - decode (T = 1): GiB/s of expert weights streamed, for the native executor (1 and all threads)
    and for a torch bf16 reference (per-expert F.linear in bf16, torch's own threads)
  - prefill (T = 512): time per layer, GiB/s of weights and GFLOP/s of the native executor
  - the same native decode/prefill figures for each quantised format of --formats (banks of
    random bytes: the kernels' speed does not depend on the values), where GiB/s counts the bytes
    a call really reads (packed weights + scale banks), and a summary of time per call vs bf16;
    the GGUF block formats (q8_0, q4_k) run on the integer-dot executor (block_executor.py, on
    ftdense's pool of the same thread count)

Usage: python tests/bench/bench_native_executor.py [--iters N] [--threads N] [--formats a,b]
Every decode call routes to 8 fresh random experts, so weights come from DRAM, not cache.

--cpu-time (for a shared, noisy machine): only the GGUF block formats of --formats (default
q4_k,q6_k,q8_0), one thread, banks quantised from random values; per round one call of every
format at T = 1 and one at T = --prefill-t (fresh random routes each call), interleaved over
--iters rounds, timed in the calling thread's CPU time; prints medians (ms per call and GB/s of
the expert bytes the call reads: distinct experts x bytes per expert).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeAlias

import numpy as np
import torch
import torch.nn.functional as F

from freetokend.experts.banks import ActivationSpec, ExpertBanks
from freetokend.experts.block_executor import BlockExecutor, is_block_format
from freetokend.experts.cpu_executor import QUANT_FORMATS, CpuExecutor
from freetokend.experts.formats import allocate, get_format
from freetokend.formats import gguf_blocks
from freetokend.native import dense_native

H, INTER, E, K = 2048, 768, 128, 8
GIB = 1024**3


def make_banks() -> ExpertBanks:
    gate_up = torch.empty(E, 2 * INTER, H, dtype=torch.bfloat16).uniform_(-0.03, 0.03)
    down = torch.empty(E, H, INTER, dtype=torch.bfloat16).uniform_(-0.03, 0.03)
    return ExpertBanks(gate_up, down)


def make_quant_banks(fmt: str) -> ExpertBanks:
    """Banks of a quantised format filled with random bytes (no e4m3 NaN codes) and scales that
    keep the activations finite."""
    b = allocate(fmt, E, H, INTER, torch.bfloat16)
    types = get_format(fmt).block_types or ("", "")
    for w, qt in zip((b.gate_up, b.down), types, strict=True):
        u8 = w.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8))
        if fmt == "fp8_block":
            u8[(u8 & 0x7F) == 0x7F] &= 0xF0
        if qt:  # a block's leading fp16 scale(s) (q4_k: d and dmin) set to 2^-10
            blocks = u8.view(E, u8.shape[1], -1, gguf_blocks.BLOCK_BYTES[qt])
            blocks[..., : 4 if qt == "q4_k" else 2] = torch.tensor([0, 0x14] * 2)[
                : 4 if qt == "q4_k" else 2
            ].to(torch.uint8)
    for name, t in b.extra.items():
        if fmt == "fp8_block":
            t.fill_(1e-4)
        elif name.endswith("global"):
            t.fill_(1e-3)
        else:  # e8m0 2^-7, or e4m3 0.5 (nvfp4)
            t.view(torch.uint8).fill_(120 if fmt == "mxfp4" else 0x30)
    return b


def routes(t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(t, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, K, generator=gen)
    return x, ids, w


def expert_bytes(banks: ExpertBanks) -> int:
    """Bytes a call reads per expert: weights plus, for quantised formats, the scale banks."""
    return sum(t[0].numel() * t.element_size() for t in banks.all_tensors().values())


def timed(fn: Callable[[], object], iters: int) -> tuple[float, float]:
    """(min, median) seconds per call after one warm-up call. On a shared machine the minimum is
    the undisturbed figure (a call is shorter than a scheduler time slice)."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), float(np.median(times))


def report(label: str, nbytes: float, t: tuple[float, float]) -> None:
    best, med = t
    print(
        f"{label:46s} {nbytes / best / GIB:6.1f} GiB/s best, {nbytes / med / GIB:6.1f} median"
        f"  ({best * 1e3:.2f} ms best)"
    )


def torch_bf16_moe(
    x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, banks: ExpertBanks
) -> torch.Tensor:
    """What a torch-only CPU path does: per expert, bf16 GEMV/GEMM, fp32 accumulation of outputs."""
    out = torch.zeros(x.shape[0], H)
    xb = x.bfloat16()
    for fid in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == fid, as_tuple=True)
        h = F.linear(xb[tok], banks.gate_up[fid])
        a = F.silu(h[:, :INTER]) * h[:, INTER:]
        y = F.linear(a, banks.down[fid]).float()
        out.index_add_(0, tok, y * w[tok, slot].unsqueeze(-1))
    return out


def bench_read(banks: ExpertBanks, iters: int) -> None:
    """Sum the bank bytes (viewed as fp32: finite, no denormals for these weights) in slices as
    large as one decode call reads (8 experts): numpy on one core, and torch's vectorised sum on
    one core and on two (two Python threads, one half each; torch releases the GIL)."""
    flat = banks.gate_up.view(-1).view(torch.float32)
    words = K * expert_bytes(banks) // 4
    slices = [flat[i * words : (i + 1) * words] for i in range(flat.numel() // words)]
    n = iter(range(1 << 30))
    arrays = [s.numpy() for s in slices]
    t = timed(lambda: arrays[next(n) % len(arrays)].sum(), iters)
    report("plain read  numpy sum, 1 thread", words * 4, t)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t = timed(lambda: slices[next(n) % len(slices)].sum(), iters)
    report("plain read  torch sum, 1 thread", words * 4, t)
    pool = ThreadPoolExecutor(2)
    halves = [(s[: words // 2], s[words // 2 :]) for s in slices]
    t = timed(lambda: list(pool.map(torch.sum, halves[next(n) % len(halves)])), iters)
    report("plain read  torch sum, 2 threads", words * 4, t)
    pool.shutdown()
    torch.set_num_threads(threads)


Executor: TypeAlias = CpuExecutor | BlockExecutor


def make_executor(banks: ExpertBanks, threads: int | None) -> Executor:
    """The native executor of the banks' format with ``threads`` threads (None: the default)."""
    if is_block_format(banks.format):
        dense_native.configure(threads)
        return BlockExecutor(banks, ActivationSpec())
    return CpuExecutor(banks, ActivationSpec(), threads=threads)


def bench_decode(banks: ExpertBanks, ex: Executor, label: str, iters: int) -> float:
    """Reports and returns the best seconds per T = 1 call."""
    gen = torch.Generator().manual_seed(0)
    batches = [routes(1, gen) for _ in range(iters + 1)]
    it = iter(batches)
    t = timed(lambda: ex.forward(*next(it)), iters)
    report(f"decode T=1  {label}", K * expert_bytes(banks), t)
    return t[0]


def bench_prefill(banks: ExpertBanks, ex: Executor, label: str, iters: int) -> float:
    """Reports and returns the best seconds per T = 512 call."""
    x, ids, w = routes(512, torch.Generator().manual_seed(2))
    distinct = int(torch.unique(ids).numel())
    t, _median = timed(lambda: ex.forward(x, ids, w), iters)
    flops = 2 * 3 * H * INTER * ids.numel()
    print(
        f"prefill T=512 {label}: {t * 1e3:.0f} ms/layer, "
        f"{distinct * expert_bytes(banks) / t / GIB:.1f} GiB/s of weights, "
        f"{flops / t / 1e9:.1f} GFLOP/s, {512 / t:.0f} tokens/s"
    )
    return t


def bench_format(fmt: str, args: argparse.Namespace) -> tuple[int, float, float]:
    """Native decode (1 and all threads) and prefill on banks of `fmt` -> (bytes per expert,
    best decode seconds with all threads, best prefill seconds)."""
    banks = make_quant_banks(fmt)
    ex1 = make_executor(banks, 1)
    bench_decode(banks, ex1, f"native {fmt} {ex1.isa}, 1 thread", args.iters)
    del ex1
    exn = make_executor(banks, args.threads)
    label = f"native {fmt} {exn.isa}, {exn.threads} threads"
    dec = bench_decode(banks, exn, label, args.iters)
    return expert_bytes(banks), dec, bench_prefill(banks, exn, label, 1)


def make_block_banks(fmt: str) -> ExpertBanks:
    """Banks of a GGUF block format: every projection row tiled from 256 rows quantised from
    random values (well-formed scales, so no inf/NaN/denormal slows a kernel)."""
    b = allocate(fmt, E, H, INTER, torch.bfloat16)
    for w, k in ((b.gate_up, H), (b.down, INTER)):
        tile = gguf_blocks.quantize(torch.randn(256, k) * 0.02, fmt)
        rows = w.view(-1, w.shape[-1])
        for r0 in range(0, rows.shape[0], 256):
            rows[r0 : r0 + 256].copy_(tile[: rows.shape[0] - r0])
    return b


def bench_blocks_cpu_time(args: argparse.Namespace) -> None:
    """The --cpu-time mode (module docstring): medians of interleaved rounds, one thread."""
    fmts = [f for f in args.formats.split(",") if is_block_format(f)] if args.formats else []
    fmts = fmts or ["q4_k", "q6_k", "q8_0"]
    dense_native.configure(1)
    exs = {f: BlockExecutor(make_block_banks(f), ActivationSpec()) for f in fmts}
    per_expert = {f: expert_bytes(ex.banks) for f, ex in exs.items()}
    gen = torch.Generator().manual_seed(0)
    sizes = (1, args.prefill_t)
    times: dict[tuple[str, int], list[float]] = {(f, t): [] for f in fmts for t in sizes}
    nbytes: dict[tuple[str, int], list[int]] = {key: [] for key in times}
    for r in range(-2, args.iters):  # 2 warm-up rounds
        for t in sizes:
            x, ids, w = routes(t, gen)
            distinct = int(torch.unique(ids).numel())
            for f, ex in exs.items():
                t0 = time.thread_time()
                ex.forward(x, ids, w)
                dt = time.thread_time() - t0
                if r >= 0:
                    times[f, t].append(dt)
                    nbytes[f, t].append(distinct * per_expert[f])
    isa = next(iter(exs.values())).isa
    print(f"MoE layer H={H} I={INTER} E={E} top-{K}, 1 thread, qdot isa {isa}, thread CPU time,")
    print(f"medians of {args.iters} interleaved rounds (fresh routes per call)")
    print(f"{'format':8s} {'T':>4s} {'ms/call':>8s} {'GB/s':>6s} {'ms/token':>8s}")
    for (f, t), ts in times.items():
        sec = float(np.median(ts))
        gbs = float(np.median(nbytes[f, t])) / sec / 1e9
        print(f"{f:8s} {t:4d} {sec * 1e3:8.3f} {gbs:6.2f} {sec * 1e3 / t:8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40, help="decode calls per measurement")
    ap.add_argument("--threads", type=int, default=None, help="executor threads (default: cores)")
    ap.add_argument("--prefill-iters", type=int, default=2)
    ap.add_argument(
        "--formats",
        default=",".join((*QUANT_FORMATS, "q8_0", "q4_k")),
        help="quantised formats to add ('' none)",
    )
    ap.add_argument("--cpu-time", action="store_true", help="block formats, 1 thread, CPU time")
    ap.add_argument("--prefill-t", type=int, default=32, help="tokens of --cpu-time's batch")
    args = ap.parse_args()
    if args.iters < 1 or args.prefill_iters < 1:
        ap.error("--iters and --prefill-iters take at least 1")
    if args.cpu_time:
        if args.formats == ap.get_default("formats"):
            args.formats = "q4_k,q6_k,q8_0"
        bench_blocks_cpu_time(args)
        return

    banks = make_banks()
    print(f"Qwen3-30B-A3B layer: {E} experts x {expert_bytes(banks) / 2**20:.1f} MiB bf16, top-{K}")
    bench_read(banks, args.iters)

    act = ActivationSpec()
    ex1 = CpuExecutor(banks, act, threads=1)
    exn = CpuExecutor(banks, act, threads=args.threads)
    bench_decode(banks, ex1, f"native {ex1.isa}, 1 thread", args.iters)
    dec = bench_decode(banks, exn, f"native {exn.isa}, {exn.threads} threads", args.iters)
    del ex1

    gen = torch.Generator().manual_seed(1)
    batches = [routes(1, gen) for _ in range(max(3, args.iters // 4) + 1)]
    it = iter(batches)
    t_ref = timed(lambda: torch_bf16_moe(*next(it), banks), max(3, args.iters // 4))
    threads = torch.get_num_threads()
    report(f"decode T=1  torch bf16 F.linear, {threads} threads", K * expert_bytes(banks), t_ref)

    label = f"native {exn.isa}, {exn.threads} threads"
    pre = bench_prefill(banks, exn, label, args.prefill_iters)
    del exn

    rows = [("bf16", H * INTER * 3 * 2, dec, pre)]
    for fmt in filter(None, args.formats.split(",")):
        rows.append((fmt, *bench_format(fmt, args)))
    print(f"\n{'format':10s} {'MiB/expert':>10s} {'decode ms':>9s} {'GiB/s':>6s} {'vs bf16':>7s}")
    for fmt, nbytes, d, p in rows:
        print(
            f"{fmt:10s} {nbytes / 2**20:10.2f} {d * 1e3:9.3f} {K * nbytes / d / GIB:6.1f} "
            f"{dec / d:6.2f}x   prefill {p * 1e3:.0f} ms ({pre / p:.2f}x)"
        )


if __name__ == "__main__":
    main()
