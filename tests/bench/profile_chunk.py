"""What a small prefill chunk costs at a long context, by part (issue 44: chunked prefill mixed
with decode wants a few-row chunk to cost about what as many decode rows do).

    PYTHONPATH=... .venv/bin/python tests/bench/profile_chunk.py MODEL [--contexts 4096 16384]
        [--rows 1 2 8 32] [--repeats 3] [--threads 2] [--isa avx2]

For each context it prefills a prompt of that many random ids once, then, --repeats times per
row count, a request of that prompt plus n new ids: the prefix cache restores the prompt's KV, so
the step prefills a chunk of n rows that attends to context + n keys (n = 1 runs the decode
path). The parts are profile_prefill.py's timers (attention, experts, dense projections, norms,
router, rope, lm_head); "rest" is the request's wall time outside them (Python, sampling, the
scheduler). A last line times decode steps at the context (a request of 9 generated tokens, its
wall time over 9). Prints the median wall milliseconds of each part per layer, and of the request.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import profile_prefill as pp  # beside this script
from profile_decode import _instrument


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
    a = ap.parse_args()

    import torch

    from freetokend import LLM
    from freetokend.models.layers import rope

    torch.set_num_threads(a.threads)
    if a.isa:
        from decode_workers import force_isa  # beside this script

        force_isa(a.isa)
    longest = max(a.contexts) + max(a.rows) + 64
    llm = LLM(
        a.model,
        moe_backend="cpu",
        threads=a.threads,
        max_model_len=longest,
        kv_tokens=2 * longest + 256,
    )
    cfg = llm.config
    _instrument(cfg.vocab_size, pp._timed, "attention")
    rope.Rope.apply = pp._timed("rope", rope.Rope.apply)  # type: ignore[method-assign]
    rng = random.Random(1)
    ids = (300, min(50000, cfg.vocab_size - 1))
    layers = cfg.num_layers
    llm.generate([rng.randrange(*ids) for _ in range(64)], max_tokens=1)  # warm-up
    for ctx in a.contexts:
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
        # decode steps at this context: one request of 1 new id and `steps` generated tokens
        steps = 8
        walls = []
        for _ in range(a.repeats):
            extra = [rng.randrange(*ids)]
            t0 = time.perf_counter()
            llm.generate(prompt + extra, max_tokens=steps + 1)
            walls.append(time.perf_counter() - t0)
        print(f"decode: {1e3 * statistics.median(walls) / (steps + 1):.1f} ms a token (request)")


if __name__ == "__main__":
    main()
