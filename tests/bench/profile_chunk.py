"""What a small prefill chunk costs at a long context, by part (issue 44: chunked prefill mixed
with decode wants a few-row chunk to cost about what as many decode rows do).

    PYTHONPATH=... .venv/bin/python tests/bench/profile_chunk.py MODEL [--contexts 4096 16384]
        [--rows 1 2 8 32] [--repeats 3] [--threads 2] [--isa avx2]
    ... profile_chunk.py MODEL --mixed 2 [--contexts 2048] [--steps 300]

For each context it prefills a prompt of that many random ids once, then, --repeats times per
row count, a request of that prompt plus n new ids: the prefix cache restores the prompt's KV, so
the step prefills a chunk of n rows that attends to context + n keys (n = 1 runs the decode
path). The parts are profile_prefill.py's timers (attention, experts, dense projections, norms,
router, rope, lm_head); "rest" is the request's wall time outside them (Python, sampling, the
scheduler). Prints the median wall milliseconds of each part per layer, and of the request. A
last line times decode steps at the context (a request of 9 generated tokens, its wall time over
9).

--mixed X: the engine paced (mixed_step_budget X) instead: a 32-token request and a request of
the first --contexts length arrive together, both generating --steps tokens: the first step
prefills the short prompt and the long one's first 480 tokens (max_step_tokens 512), the rest of
the long prompt prefills beside the short request's decode row. Per prompt-chunk size of the steps with one decode row: the
steps, their median milliseconds and parts (whole model), and the sizes step by step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from typing import Any

import profile_prefill as pp  # beside this script


def chunks(llm: Any, ctx: int, a: argparse.Namespace, rng: random.Random, ids: tuple) -> None:
    layers = llm.config.num_layers
    prompt = [rng.randrange(*ids) for _ in range(ctx)]
    t0 = time.perf_counter()
    llm.generate(prompt, max_tokens=1)
    print(f"context {ctx}: prompt prefilled in {time.perf_counter() - t0:.1f} s")
    print(f"{'rows':>5} {'request ms':>10}  per layer ms: parts (rest: whole request)")
    for n in a.rows:
        runs: list[tuple[float, dict[str, float]]] = []
        for _ in range(a.repeats):
            extra = [rng.randrange(*ids) for _ in range(n)]
            pp._wall.clear()
            t0 = time.perf_counter()
            llm.generate(prompt + extra, max_tokens=1)
            runs.append((time.perf_counter() - t0, dict(pp._wall)))
        wall = statistics.median(r[0] for r in runs)
        names = sorted({k for r in runs for k in r[1]})
        med = {k: statistics.median(r[1].get(k, 0.0) for r in runs) for k in names}
        rest = statistics.median(r[0] - sum(r[1].values()) for r in runs)
        parts = ", ".join(
            f"{k} {1e3 * v / (1 if k == 'lm_head' else layers):.2f}"
            for k, v in sorted(med.items(), key=lambda kv: -kv[1])
        )
        print(f"{n:5d} {1e3 * wall:10.1f}  {parts}; rest {1e3 * rest:.1f}")
    steps, walls = 8, []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        llm.generate(prompt + [rng.randrange(*ids)], max_tokens=steps + 1)
        walls.append(time.perf_counter() - t0)
    print(f"decode: {1e3 * statistics.median(walls) / (steps + 1):.1f} ms a token (request)")


def mixed(llm: Any, a: argparse.Namespace, rng: random.Random, ids: tuple) -> None:
    from freetokend.engine import pacing

    log: list[tuple[int, int, float, dict[str, float]]] = []
    observe = pacing.StepPacer.observe

    def logged(self: Any, rows: int, tokens: int, seconds: float) -> None:
        log.append((rows, tokens, seconds, dict(pp._wall)))
        pp._wall.clear()
        observe(self, rows, tokens, seconds)

    pacing.StepPacer.observe = logged  # type: ignore[method-assign]
    prompts = [[rng.randrange(*ids) for _ in range(n)] for n in (32, a.contexts[0])]
    pp._wall.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, max_tokens=a.steps, ignore_eos=True)
    print(f"budget {a.mixed}: {len(log)} steps in {time.perf_counter() - t0:.1f} s")
    by: dict[int, list[tuple[float, dict[str, float]]]] = defaultdict(list)
    for rows, tokens, s, parts in log:
        if rows == 1:
            by[tokens].append((s, parts))
    for n, runs in sorted(by.items()):
        names = sorted({k for r in runs for k in r[1]})
        med = {k: statistics.median(r[1].get(k, 0.0) for r in runs) for k in names}
        parts = ", ".join(
            f"{k} {1e3 * v:.1f}" for k, v in sorted(med.items(), key=lambda kv: -kv[1])
        )
        wall = statistics.median(r[0] for r in runs)
        print(f"chunk {n:4d}: {len(runs):4d} steps, median {1e3 * wall:.1f} ms; {parts}")
    sizes = "".join(str(min(t, 9)) if r == 1 else "." for r, t, _, _ in log)
    print(f"chunk sizes beside the decode row, step by step (9: 9 or more, .: other): {sizes}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default="", choices=("", "avx2", "avx512", "scalar"))
    ap.add_argument("--mixed", type=float, default=0.0, help="the paced run at this budget")
    ap.add_argument("--steps", type=int, default=300, help="tokens each request generates")
    a = ap.parse_args()
    longest = max(a.contexts) + max(max(a.rows), a.steps) + 64
    llm = pp.load_instrumented(
        a, max_model_len=longest, kv_tokens=2 * longest + 256, mixed_step_budget=a.mixed
    )
    rng = random.Random(1)
    ids = (300, min(50000, llm.config.vocab_size - 1))
    llm.generate([rng.randrange(*ids) for _ in range(64)], max_tokens=1)  # warm-up
    if a.mixed:
        mixed(llm, a, rng, ids)
        return
    for ctx in a.contexts:
        chunks(llm, ctx, a, rng, ids)


if __name__ == "__main__":
    main()
