"""Decode with CUDA graphs on vs off on a real GPU (engine/graphs.py; part of tests/gpu/check.sh).

On a random model of Qwen3-30B-A3B layer geometry (bench_backends.checkpoint), for fused and
offload (half the experts in slots), batches of 1 and 3 (bucket 4: one padding row): the greedy
tokens with ``cuda_graphs`` must agree with those without (equal, or parting only at a near-tie
of the eager engine's logits: the graph runs a padded batch, whose matmuls may round apart;
tests/greedy_check.py), the graphs must have been captured and replayed, and the decode tok/s of
both are printed.

    python tests/gpu/graphs_check.py [--layers 4] [--decode 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_backends import checkpoint  # noqa: E402
from greedy_check import assert_greedy_agrees  # noqa: E402

# A bf16 checkpoint: logits of order 10 move in bf16 steps of 1/16 there; a near-tie is within
# two of them.
BF16_MARGIN = 0.125


def run(d: Path, backend: str, graphs: bool, batch: int, args: argparse.Namespace) -> tuple:
    from freetokend import LLM

    slots = None if backend == "fused" else args.slots or args.layers * 128 // 2
    llm = LLM(d, backend, accelerator="cuda", max_model_len=512, kv_tokens=4096,
              moe_slots=slots, prefix_cache=False, cuda_graphs=graphs)  # fmt: skip
    assert (llm.runner.graphs is not None) == graphs, "graphs were not captured (see the log)"
    g = torch.Generator().manual_seed(batch)
    vocab = llm.config.vocab_size
    prompts = [torch.randint(0, vocab, (16 + 7 * i,), generator=g).tolist() for i in range(batch)]
    llm.generate(prompts, max_tokens=4, ignore_eos=True)  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate(prompts, max_tokens=args.decode, ignore_eos=True)
    torch.cuda.synchronize()
    tok_s = batch * args.decode / (time.perf_counter() - t0)
    replays = llm.runner.graphs.replays if llm.runner.graphs is not None else 0
    return out, tok_s, replays, prompts, llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--slots", type=int, help="offload's expert slots (default: half)")
    ap.add_argument("--model", type=Path, default=Path("/tmp/ft-bench-qwen3-30b-geometry"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    d = checkpoint(args.model / f"l{args.layers}", args.layers)
    lines = [
        f"CUDA graphs on vs off, Qwen3-30B-A3B geometry, {args.layers} layers, "
        f"{args.decode} decode tokens per sequence (greedy)",
        f"{'case':24s} {'eager tok/s':>12s} {'graphs tok/s':>13s} {'speed-up':>9s}  "
        "replays  tokens",
    ]
    ok = True
    for backend in ("fused", "offload"):
        for batch in (1, 3):
            name = f"{backend}, batch {batch}"
            try:
                ref, eager, _, prompts, eager_llm = run(d, backend, False, batch, args)
                got, fast, replays, _, _ = run(d, backend, True, batch, args)
                parted = assert_greedy_agrees(got, ref, prompts, eager_llm, BF16_MARGIN, name)
            except Exception as e:  # noqa: BLE001 - a failing case is a row, not the end
                lines.append(f"{name:24s} FAILED: {type(e).__name__}: {e}"[:300])
                ok = False
                continue
            same = "yes" if parted == 0 else f"{parted} near-tie"
            ok = ok and replays > 0
            lines.append(
                f"{name:24s} {eager:12.2f} {fast:13.2f} {fast / eager:8.2f}x  {replays:7d}  {same}"
            )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
