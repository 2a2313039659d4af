"""Prefill through the double-buffered slot pool, overlap on vs off (prints a table).

Builds (once, cached) a random Qwen3-MoE checkpoint with transformers, then times a 512-token
prefill with the offload backend: full-layer buffers with the next layer's copy overlapping the
current layer's compute, the same without overlap, and on-demand loading (too few slots for two
buffers). On the CPU stand-in the "copies" are memcpy on a worker thread; the figures that matter
come from `--accelerator cuda` (tests/gpu/check.sh).

    python tests/bench/bench_prefill_overlap.py [--accelerator standin|cuda] [--tokens 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def checkpoint(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        intermediate_size=2048,
        max_position_embeddings=4096,
        initializer_range=0.05,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--accelerator", default="standin", choices=["standin", "cuda"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--model", type=Path, default=Path("/tmp/ft-bench-prefill-qwen3moe"))
    args = ap.parse_args()
    from freetokend import LLM

    d = checkpoint(args.model)
    prompt = torch.randint(
        0, 4096, (args.tokens,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    rows = []
    probe = LLM(d, max_model_len=args.tokens + 8, kv_tokens=args.tokens + 16)
    e = probe.config.num_experts
    del probe
    cases = [
        ("cpu backend", dict(moe_backend="cpu"), None),
        ("offload, double buffer + overlap", dict(moe_backend="offload", moe_slots=2 * e), True),
        ("offload, double buffer, no overlap", dict(moe_backend="offload", moe_slots=2 * e), False),
        ("offload, on demand (2E-1 slots)", dict(moe_backend="offload", moe_slots=2 * e - 1), True),
    ]
    ref = None
    for name, kw, overlap in cases:
        llm = LLM(
            d,
            max_model_len=args.tokens + 8,
            kv_tokens=args.tokens + 16,
            accelerator=args.accelerator,
            **kw,
        )
        if overlap is not None:
            llm.moe.prefill_overlap = overlap
        llm.generate(prompt[:64], max_tokens=1)  # warm-up
        t0 = time.perf_counter()
        out = llm.generate(prompt, max_tokens=1)
        dt = time.perf_counter() - t0
        ref = ref or out
        rows.append((name, args.tokens / dt, out == ref))
        del llm
    print(f"prefill of {args.tokens} tokens, accelerator={args.accelerator}")
    print(f"{'case':40s} {'tok/s':>10s}  same first token")
    for name, tps, same in rows:
        print(f"{name:40s} {tps:10.1f}  {same}")


if __name__ == "__main__":
    main()
