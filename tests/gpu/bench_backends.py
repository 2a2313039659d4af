"""Decode and prefill throughput of fused / offload / hybrid, and of the cpu backend beside them,
on a random model of Qwen3-30B-A3B layer geometry (H 2048, 128 experts of I 768, top-8, 32 query
/ 4 KV heads) with few layers; prints one table (part of tests/gpu/check.sh).

The expert cache is capped at what 8 GiB and 24 GiB cards leave for experts of the FULL 48-layer
model: slots = num_flat x cap / (48-layer expert bytes), so the per-layer hit rates are those
of the real model on that card, not of a few layers that would fit entirely.

    python tests/gpu/bench_backends.py [--layers 4] [--accelerator cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

GIB = 1 << 30
FULL_LAYERS = 48
CAPS_GIB = (8, 24)
# of a card's memory, what the experts get: dense weights (~2.2 GiB bf16 for the 48 layers),
# KV and activations take the rest
EXPERT_SHARE = {8: 5.0, 24: 20.0}


def checkpoint(path: Path, layers: int) -> Path:
    if (path / "config.json").exists():
        return path
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(
        vocab_size=8192, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, intermediate_size=6144, max_position_embeddings=8192,
        initializer_range=0.02, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def run(d: Path, args: argparse.Namespace, **kw: object) -> tuple[float, float, list[int]]:
    from freetokend import LLM

    llm = LLM(d, max_model_len=args.prefill + 64, kv_tokens=args.prefill + 128,
              accelerator=args.accelerator, prefix_cache=False, **kw)  # type: ignore[arg-type]  # fmt: skip
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 8192, (args.prefill,), generator=g).tolist()
    llm.generate(prompt[:32], max_tokens=2, ignore_eos=True)  # warm-up: compiles the kernels
    t0 = time.perf_counter()
    llm.generate(prompt, max_tokens=1, ignore_eos=True)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = llm.generate(prompt[:16], max_tokens=args.decode, ignore_eos=True)
    decode_s = time.perf_counter() - t0
    return args.prefill / prefill_s, args.decode / decode_s, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--accelerator", default="cuda", choices=["cuda", "standin"])
    ap.add_argument("--model", type=Path, default=Path("/tmp/ft-bench-qwen3-30b-geometry"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    d = checkpoint(args.model / f"l{args.layers}", args.layers)
    num_flat = args.layers * 128
    expert_bytes = 3 * 2048 * 768 * 2  # gate, up, down in bf16
    full = FULL_LAYERS * 128 * expert_bytes
    cases: list[tuple[str, dict[str, object]]] = [("fused (all experts)", {"moe_backend": "fused"})]
    # the baseline the GPU backends exist to beat: every expert and the dense part on the CPU
    cases.append(("cpu (no accelerator)", {"moe_backend": "cpu"}))
    for cap in CAPS_GIB:
        slots = max(1, min(num_flat, round(num_flat * EXPERT_SHARE[cap] * GIB / full)))
        for backend in ("offload", "hybrid"):
            cases.append((f"{backend}, {cap} GiB card ({slots} slots)",
                          {"moe_backend": backend, "moe_slots": slots}))  # fmt: skip
    lines = [
        f"Qwen3-30B-A3B geometry, {args.layers} layers, accelerator {args.accelerator}, "
        f"prefill {args.prefill} tokens, decode {args.decode} tokens (batch 1)",
        f"{'case':44s} {'prefill tok/s':>14s} {'decode tok/s':>13s}  same tokens as fused",
    ]
    print("\n".join(lines), flush=True)
    ref = None
    for name, kw in cases:  # each row printed when done: a table cut at its limit keeps them
        try:
            p, dcd, out = run(d, args, **kw)
        except Exception as e:  # noqa: BLE001 - a failing case is a row, not the end of the table
            lines.append(f"{name:44s} FAILED: {type(e).__name__}: {e}"[:300])
            print(lines[-1], flush=True)
            continue
        ref = ref if ref is not None else out
        lines.append(f"{name:44s} {p:14.1f} {dcd:13.2f}  {out == ref}")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(1 if "FAILED" in text else 0)


if __name__ == "__main__":
    main()
