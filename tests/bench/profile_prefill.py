"""Where one long prefill of freetoken's `cpu` backend spends its time, by part, with each part's
achieved rate (issue 44: time to first token on long prompts).

    PYTHONPATH=... .venv/bin/python tests/bench/profile_prefill.py MODEL [--tokens 2048]
        [--threads 2] [--rounds 1] [--isa avx2]

MODEL is a checkpoint folder or a GGUF file (bench_server.py's Q4_K_M file of Qwen3-30B-A3B's
geometry is /tmp/ftbench-server/mid-40k-q4_k_m.gguf). After a short warm-up it prefills a new
prompt of --tokens random ids (one generated token) --rounds times, with timers around the
routed experts, the dense projections (lm_head apart), the attention, norms, the router's top-k
and rope, as profile_decode.py does for decode. Per part it prints the wall seconds and the
process's CPU seconds (every thread; pool threads spinning between jobs count too), and for the
three compute parts the operations they do (a multiply-add is 2: experts top_k * 3 * hidden *
moe_intermediate a token and layer; projections q, k, v, o; attention 4 * heads * head_dim a
visible (query, key) pair) over the part's CPU seconds: the rate per core, to set against the
core's peak (Zen 3: fp32 32 flops a cycle with two 256-bit FMAs; int8 64 multiply-adds a cycle
with two vpmaddubsw, half that when each is followed by a widening vpmaddwd). On a shared
machine the wall time includes waits for a core: the CPU-time rates are the ones to read.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from profile_decode import _instrument, settle_huge_pages  # beside this script

_wall: dict[str, float] = defaultdict(float)
_cpu: dict[str, float] = defaultdict(float)
_depth = [0]


def _cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(label: Callable[..., str] | str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _depth[0]:  # a part inside another part counts in the outer one
            return fn(*args, **kwargs)
        _depth[0] += 1
        t0, c0 = time.perf_counter(), _cpu_now()
        try:
            out = fn(*args, **kwargs)
        finally:
            _depth[0] -= 1
        name = label if isinstance(label, str) else label(*args, **kwargs)
        _wall[name] += time.perf_counter() - t0
        _cpu[name] += _cpu_now() - c0
        return out

    return wrapper


def _ops(cfg: Any, n: int) -> dict[str, float]:
    """Operations (2 a multiply-add) of each compute part for a prompt of n tokens."""
    h, layers = cfg.hidden_size, cfg.num_layers
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    moe_layers = sum(cfg.moe_layers) if cfg.moe_layers else layers
    return {
        "routed experts": 2.0 * n * moe_layers * cfg.top_k * 3 * h * cfg.moe_intermediate_size,
        "dense projections": 2.0 * n * layers * (h * (qd + 2 * kvd) + qd * h),
        "attention": 4.0 * cfg.num_heads * cfg.head_dim * layers * n * (n + 1) / 2,
    }


def load_instrumented(a: argparse.Namespace, **kwargs: Any) -> Any:
    """An `LLM` of ``a.model`` on the cpu backend with ``a.threads`` threads (``a.isa`` forced
    where set; ``kwargs``: more of its fields), with this script's timers around the parts."""
    import torch

    from freetokend import LLM
    from freetokend.models.layers import rope

    torch.set_num_threads(a.threads)
    if a.isa:
        from decode_workers import force_isa  # beside this script

        force_isa(a.isa)
    llm = LLM(a.model, moe_backend="cpu", threads=a.threads, **kwargs)
    settle_huge_pages()
    _instrument(llm.config.vocab_size, _timed, "attention")  # profile_decode's parts, these timers
    rope.Rope.apply = _timed("rope", rope.Rope.apply)  # type: ignore[method-assign]
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--isa", default="", choices=("", "avx2", "avx512", "scalar"))
    a = ap.parse_args()
    llm = load_instrumented(a, max_model_len=a.tokens + 64, kv_tokens=a.tokens + 128)
    cfg = llm.config
    rng = random.Random(1)
    ids = (300, min(50000, cfg.vocab_size - 1))  # no special or byte-fallback ids (bench_server)
    llm.generate([rng.randrange(*ids) for _ in range(64)], max_tokens=1)  # warm-up
    rounds: list[tuple[float, float, dict[str, float], dict[str, float]]] = []
    for _ in range(a.rounds):
        prompt = [rng.randrange(*ids) for _ in range(a.tokens)]
        _wall.clear()
        _cpu.clear()
        t0, c0 = time.perf_counter(), _cpu_now()
        llm.generate(prompt, max_tokens=1)
        rounds.append((time.perf_counter() - t0, _cpu_now() - c0, dict(_wall), dict(_cpu)))
    wall, cpu, walls, cpus = sorted(rounds, key=lambda r: r[0])[len(rounds) // 2]
    ops = _ops(cfg, a.tokens)
    print(
        f"{a.model}: {cfg.num_layers} layers, prefill of {a.tokens} tokens, {a.threads} threads: "
        f"{wall:.2f} s wall ({a.tokens / wall:.1f} tok/s), {cpu:.2f} s CPU "
        f"(rounds: {', '.join(f'{r[0]:.2f}' for r in rounds)}; median "
        f"{statistics.median(r[0] for r in rounds):.2f} s)"
    )
    print(f"{'part':<20} {'wall s':>8} {'share':>6} {'cpu s':>8} {'Gop':>8} {'Gop/s/core':>11}")
    for k, v in sorted(walls.items(), key=lambda kv: -kv[1]):
        g = ops.get(k)
        rate = f"{g / cpus[k] / 1e9:11.1f}" if g and cpus[k] > 0 else f"{'':>11}"
        gops = f"{g / 1e9:8.1f}" if g else f"{'':>8}"
        print(f"{k:<20} {v:8.3f} {100 * v / wall:5.1f}% {cpus[k]:8.3f} {gops} {rate}")
    print(f"{'rest':<20} {wall - sum(walls.values()):8.3f} {'':>6} {cpu - sum(cpus.values()):8.3f}")


if __name__ == "__main__":
    main()
