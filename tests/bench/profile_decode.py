"""Where one decode step of freetoken's `cpu` backend spends its time, by part.

    .venv/bin/python tests/bench/profile_decode.py MODEL [--threads 2] [--tokens 64]
        [--quantize q4_k_m] [--quantize-experts q4_k] [--fp32-act] [--isa avx2] [--generic]
        [--split-native] [--streams 1]

MODEL is a checkpoint folder or a GGUF file (the decode benchmark's are in
/tmp/ftbench_decode: `mid/`, `mid-q4_k_m.gguf`, ...). After a warm-up, it decodes --tokens
greedy tokens --rounds times with a wall-clock timer around each part of the forward (the dense
projections split into lm_head and the rest, the routed experts, decode attention, norms, the
router's top-k, rope) and prints milliseconds per token for each, the median round's; "glue" is the
step's time less the parts (Python, torch's small ops, the scheduler and the sampler). Layers that
take the native decode path (models/layers/cpu_decode.py) count as one part, "native decode
layers" (with the embedding gather, the last norm and lm_head inside it when every layer takes
that path: then a step is one native call, made by the runner's decode lane), unless --generic
switches that path off. The timers cost a few microseconds a call, so
the step is a little slower than in bench_decode.py. With --streams N, each round decodes N
requests (distinct prompts) side by side, every step a batch of N rows: the figures are per step
(N tokens), timed from the first step after every request's prefill.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

_acc: dict[str, float] = defaultdict(float)


def _timed(label: Callable[..., str] | str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        name = label if isinstance(label, str) else label(*args, **kwargs)
        _acc[name] += time.perf_counter() - t0
        return out

    return wrapper


def settle_huge_pages() -> None:
    """Waits for the load's huge-page collapse (models/hugepages.py, a thread named
    ``ft-hugepages``) to end: collapsing a 5 GB bf16 pool holds a core for ~15 s after the load
    (Zen 4 VM), which a profile taken beside it counts in every part."""
    for t in threading.enumerate():
        if t.name == "ft-hugepages":
            t.join()


def _instrument(
    vocab: int,
    _timed: Callable[[Any, Callable[..., Any]], Callable[..., Any]] = _timed,
    attention_part: str = "decode attention",
) -> None:
    """Timers around the parts, patched where the forward looks them up (``_timed``: the timer
    to wrap them in; profile_prefill.py passes its own)."""
    from freetokend.experts import backend
    from freetokend.models.layers import attention, common, cpu_decode, decode_lane, moe

    def linear_label(self: Any, x: Any) -> str:
        rows = self.qweight.rows if self.qweight is not None else self.weight.shape[0]
        return "lm_head" if rows == vocab else "dense projections"

    common.Linear.forward = _timed(linear_label, common.Linear.forward)  # type: ignore[method-assign]
    proj = _timed("dense projections", common.project)
    attention.project = proj  # type: ignore[attr-defined]
    common.project = proj
    attention.paged_attention = _timed(attention_part, attention.paged_attention)  # type: ignore[attr-defined]
    common.RMSNorm.forward = _timed("norms", common.RMSNorm.forward)  # type: ignore[method-assign]
    moe.route = _timed("router top-k", moe.route)  # type: ignore[attr-defined]
    backend.CpuBackend.forward = _timed("routed experts", backend.CpuBackend.forward)  # type: ignore[method-assign]
    cpu_decode.DecodeStep.run = _timed("native decode layers", cpu_decode.DecodeStep.run)  # type: ignore[method-assign]
    # the runner's decode lane: the same call, with its few writes of the step's rows
    decode_lane.DecodeLane.forward = _timed("native decode layers", decode_lane.DecodeLane.forward)  # type: ignore[method-assign]


def _instrument_native() -> Any:
    """Timers inside the native decode layers instead: each projection group, the experts and
    every small native op (attention, norms, rope, routing) as its own part, timed by the native
    call itself (cpu_decode.set_timings). Returns the seconds tensor."""
    import torch

    from freetokend.models.layers import cpu_decode
    from freetokend.native import dense_native

    parts = dense_native._native.decode_parts()
    seconds = torch.zeros(len(parts), dtype=torch.float64)
    cpu_decode.set_timings(seconds)
    return parts, seconds


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--quantize-experts", default=None)
    ap.add_argument(
        "--fp32-act",
        action="store_true",
        help="bf16 weights on the fp32-activation kernels (cpu_bf16_dot off)",
    )
    ap.add_argument(
        "--isa",
        default="",
        choices=("", "avx2", "avx512", "scalar"),
        help="every kernel on this path, as bench_decode's --isa (avx2: a CPU without AVX-512)",
    )
    ap.add_argument("--generic", action="store_true", help="without the native decode path")
    ap.add_argument("--streams", type=int, default=1, help="requests decoded side by side")
    ap.add_argument(
        "--split-native",
        action="store_true",
        help="time each call inside the native decode layers (projections, experts, small ops)",
    )
    a = ap.parse_args()

    import torch

    from freetokend import LLM
    from freetokend.engine.sampler import SamplingParams
    from freetokend.models.layers import cpu_decode, rope

    torch.set_num_threads(a.threads)
    cpu_decode.set_enabled(not a.generic)
    if a.isa:  # as bench_decode's workers force it
        from decode_workers import force_isa  # beside this script

        force_isa(a.isa)
    llm = LLM(
        a.model,
        moe_backend="cpu",
        threads=a.threads,
        max_model_len=4096,
        quantize=a.quantize,
        quantize_experts=a.quantize_experts,
        cpu_bf16_dot=not a.fp32_act,
    )
    settle_huge_pages()
    vocab = llm.config.vocab_size
    _instrument(vocab)
    native = _instrument_native() if a.split_native else None
    rope.Rope.apply = _timed("rope", rope.Rope.apply)  # type: ignore[method-assign]
    step = _timed("step", llm.engine.step)
    rounds: list[dict[str, float]] = []
    for r in range(a.rounds + 1):  # the first is the warm-up
        reqs = []
        for s in range(a.streams):
            prompt = [(7 * i + 3 + 101 * s) % (vocab - 1) for i in range(16)]
            reqs.append(f"p{r}.{s}")
            llm.engine.add_request(
                reqs[-1],
                prompt,
                SamplingParams(max_tokens=a.tokens + 1, temperature=0.0, ignore_eos=True),
            )
        sched = llm.engine.scheduler
        while any(not q.output for q in sched.waiting) or any(not q.output for q in sched.running):
            step()  # the prefills
        _acc.clear()
        if native is not None:
            native[1].zero_()
        n = 0
        while llm.engine.has_unfinished():
            step()
            n += 1
        if native is not None:  # inside "native decode layers"
            _acc.update({f"  native {p}": float(v) for p, v in zip(*native, strict=True)})
        rounds.append({k: v * 1e3 / n for k, v in _acc.items()})
    rounds = rounds[1:]
    mid = sorted(rounds, key=lambda t: t["step"])[len(rounds) // 2]
    parts = {k: v for k, v in mid.items() if k != "step" and not k.startswith(" ")}
    print(f"{a.model}: {llm.config.num_layers} layers, {a.threads} threads, {a.streams} streams")
    print(f"{'part':<20} {'ms/step':>9}")
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"{k:<20} {v:9.3f}")
    print(f"{'glue':<20} {mid['step'] - sum(parts.values()):9.3f}")
    inner = {k: v for k, v in mid.items() if k.startswith(" ")}
    if inner:
        print("inside the native decode layers:")
        for k, v in sorted(inner.items(), key=lambda kv: -kv[1]):
            print(f"{k:<20} {v:9.3f}")
        print(f"{'  calls, Python':<20} {mid['native decode layers'] - sum(inner.values()):9.3f}")
    steps = sorted(t["step"] for t in rounds)
    print(f"{'step':<20} {mid['step']:9.3f}   (rounds: {', '.join(f'{s:.2f}' for s in steps)})")
    tok_s = a.streams * 1e3 / statistics.median(steps)
    print(f"median step {statistics.median(steps):.3f} ms = {tok_s:.1f} tok/s")


if __name__ == "__main__":
    main()
