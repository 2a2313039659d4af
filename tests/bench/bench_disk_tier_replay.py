"""The disk tier's RAM-cache policy over real routing traces (experts/disk_tier.py RamCache,
issue 45): decode hit rate by cache size, next to the byte-budget LRU of uniform sizes and the
forced-fill Belady optimum (experts/replay.py), for every trace of shared/data/routing-traces/.

The RAM cache counts uniform slots (top-k at least: a batch with more distinct experts runs a few
tokens at a time), so a size is a share of the pool's experts; a miss is an expert read from
the file. Prints one table per
trace: share, slots, RAM-cache hits (its LRU, bimodal insertion below one token's experts),
byte LRU, Belady (decode-only, %).

    .venv/bin/python tests/bench/bench_disk_tier_replay.py
    .venv/bin/python tests/bench/bench_disk_tier_replay.py --shares 0.05,0.1,0.25 --no-belady
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from freetokend.experts.replay import (
    read_trace,
    replay_ram_cache,
    simulate_belady,
    simulate_lru,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "routing-traces"
FILES = (
    "bigmoeonedge/qwen.route.csv",
    "bigmoeonedge/gptoss.route.csv",
    "onnx-genai-granite/moe_expert_trace.json",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--shares", default="0.05,0.1,0.25,0.5,0.75")
    ap.add_argument("--no-belady", action="store_true", help="skip the (slower) optimum")
    args = ap.parse_args(argv)
    shares = [float(s) for s in args.shares.split(",")]
    for rel in FILES:
        path = args.traces / rel
        if not path.exists():
            print(f"{path}: not found", file=sys.stderr)
            return 1
        tr = read_trace(path).with_expert_bytes(1)  # uniform slots: budget = slot count
        pool = tr.num_layers * tr.num_experts
        print(f"\n{tr.name}: {tr.num_layers} layers x {tr.num_experts} experts, top-{tr.top_k}")
        print(f"{'share':>6} {'slots':>6} {'RAM cache':>9} {'byte LRU':>9} {'Belady':>7}")
        for share in shares:
            slots = max(tr.top_k, int(pool * share))
            ram = replay_ram_cache(tr, slots).pct
            lru = simulate_lru(tr, slots).pct
            opt = "-" if args.no_belady else f"{simulate_belady(tr, slots).pct:.1f}"
            print(f"{share:>6.0%} {slots:>6} {ram:>9.1f} {lru:>9.1f} {opt:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
