"""DeepSeek-V4's CSA attention layer in prefill: the masked reference (every query scored
against every compressed entry, masked to the indexer's top-k) against the selected path (each
query's window and chosen entries only, `V4Attention._attend_selected`). (Not collected by
pytest.)

    FT_LLAMA_CPP_SRC=.../vendor/llama.cpp PYTHONPATH=... .venv/bin/python \\
        tests/bench/bench_v4_csa_prefill.py [--lengths 2048,8192] [--chunk 512] [--threads 2]

The layer: the CSA layer of bench_v4_prefill.py's 1-layer V4-Flash-geometry GGUF (hidden 4096,
64 heads x 512, window 128, rate 4, indexer 64 x 128 with index_topk 512; Q8_0 dense), built
and cached by that script's ``build_gguf`` and loaded by our GGUF loader. Its input: random
rows of unit RMS (the layer's input is normed), the prompt fed in chunks of --chunk tokens as
the engine's chunked prefill does. Per chunk both paths run from the same state, their order
alternating chunk by chunk, outputs checked equal (max abs difference printed) and the layer's
forward (projections, compressors, indexer and attention) timed, wall clock and the process's
CPU time (both threads; less moved by other processes on a shared machine); the totals per length are
sums over the chunks, so the two paths see the same load at the same time.

Measured 2026-12-06, AMD EPYC Zen 3 (AVX2), 2 threads, the machine shared with six other
sessions (load average 14-16 on its 2 cores: wall clock ~7x the CPU time; the ratios within a
run are the figures to read), the layer's forward summed over the chunks:

    tokens   masked wall / CPU     selected wall / CPU    ratio wall / CPU   heads' outputs
     2048     249.5 s /  27.2 s     222.8 s /  26.8 s      1.12x / 1.02x      7.4e-7 of max
     8192     969.0 s / 145.1 s     809.2 s / 123.5 s      1.20x / 1.17x      8.0e-7 of max

At 2048 tokens a query sees at most 512 entries, all chosen (index_topk 512): the same rows
either way. At 8192 the attention proper (about 1.1 TFLOP masked, a quarter of that selected)
is the smaller part of the layer: its Q8_0 projections (q_b, o_a, o_b, the indexer's q_b: about
2 TFLOP at 8k) and the indexer's scores stay. 16384 tokens not run (the masked path alone is
over an hour of wall clock at this load).

--attention-only: the attention proper of one chunk of 512 queries at the end of the prompt
(random inputs at V4-Flash's shapes, best of 2; same machine, load 9-13; outputs within 3e-7):

    tokens   masked wall / CPU   selected wall / CPU   ratio wall / CPU
     8192     15.91 s / 6.19 s    7.75 s / 3.03 s       2.05x / 2.04x
    16384     19.08 s / 9.01 s    6.02 s / 2.97 s       3.17x / 3.03x

The selected path's cost stays flat with the length (the window and 512 entries a query); it
runs at about 15 GFLOP per CPU second against the masked path's 35 (the gather and 64 small
batched products a block), so 3.2x of the 8x fewer rows at 16k.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_v4_prefill import build_gguf, cpu_name, load  # noqa: E402


def attention_only(lengths: list[int], chunk: int) -> None:
    """--attention-only: the attention proper (`_attend_masked` against `_attend_selected`) of
    the last chunk at each length, V4-Flash's shapes (64 heads x 512, window 128, top-512 of
    length / 4 entries), random inputs and a random top-k; best of 2 each, interleaved."""
    # deferred: the layer alone, no GGUF
    from freetokend.models.layers.compressed import select_topk
    from freetokend.models.layers.v4_attention import IndexerShape, V4Attention

    torch.manual_seed(0)
    attn = V4Attention(hidden=64, heads=64, head_dim=512, q_lora_rank=32, o_groups=8,
                       o_lora_rank=16, window=128, eps=1e-6, dtype=torch.float32,
                       compress_rate=4, indexer=IndexerShape(4, 16, 512))  # fmt: skip
    for n in lengths:
        start, e, w = n - chunk, n // 4, attn.window - 1
        q, keys, ent = torch.randn(chunk, 64, 512), torch.randn(w + chunk, 512), torch.randn(e, 512)
        vis = (start + torch.arange(chunk) + 1) // 4
        hidden = torch.arange(e)[None] >= vis[:, None]
        chosen = select_topk(torch.rand(chunk, e).masked_fill(hidden, -torch.inf), 512)
        best: dict[bool, list[float]] = {True: [1e9, 1e9], False: [1e9, 1e9]}
        outs = {}
        for masked in (True, False, True, False):
            t0, c0 = time.perf_counter(), time.process_time()
            if masked:
                outs[masked] = attn._attend_masked(q, keys, start, w, ent, chosen)
            else:
                outs[masked] = attn._attend_selected(q, keys, w, ent, chosen)
            dt = (time.perf_counter() - t0, time.process_time() - c0)
            best[masked] = [min(a, b) for a, b in zip(best[masked], dt, strict=True)]
        (mw, mc), (sw, sc) = best[True], best[False]
        d = (outs[True] - outs[False]).abs().max().item()
        print(f"{n:>6} tokens, the last {chunk} queries' attention: masked {mw:.2f} s / CPU "
              f"{mc:.2f} s, selected {sw:.2f} s / CPU {sc:.2f} s ({mw / sw:.2f}x / {mc / sc:.2f}x); "
              f"max |difference| {d:.1e}; load avg {load()}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/ftbench-v4"))
    ap.add_argument("--attention-only", action="store_true", help="the attention proper alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.attention_only:
        attention_only([int(x) for x in args.lengths.split(",")], args.chunk)
        return
    path = build_gguf(args.cache, 1)
    from freetokend import LLM

    llm = LLM(path, "cpu", max_model_len=max(int(x) for x in args.lengths.split(",")) + 64)
    model = llm.model
    attn = model._layers[0].self_attn
    assert attn.indexer is not None, "layer 0 of the 1-layer file is CSA"
    rope = model.rope_compress
    print(f"{cpu_name()}, {args.threads} threads; V4-Flash CSA layer: {attn.heads} heads x "
          f"{attn.head_dim}, window {attn.window}, index_topk {attn.indexer.topk}; "
          f"chunks of {args.chunk}", flush=True)  # fmt: skip
    # the heads' outputs before the output projection (whose int8 activations of a Q8_0
    # file would round differences of 1e-7 up to a Q8_0 step)
    seen: list[torch.Tensor] = []
    project = attn._output

    def capture(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        seen.append(out)
        return project(out, cos, sin)

    attn._output = capture
    for n in (int(x) for x in args.lengths.split(",")):
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, model.cfg.hidden_size, generator=g)
        st = attn.empty_state()
        t = {True: 0.0, False: 0.0}
        cpu = {True: 0.0, False: 0.0}
        worst = 0.0
        with torch.no_grad():
            for c, p in enumerate(range(0, n, args.chunk)):
                xs = x[p : p + args.chunk]
                cos, sin = rope.cos_sin(torch.arange(p, p + xs.shape[0]), n)
                outs, heads = {}, {}
                seen.clear()
                for masked in (True, False) if c % 2 == 0 else (False, True):
                    attn.masked_prefill = masked
                    t0, c0 = time.perf_counter(), time.process_time()
                    outs[masked] = attn(xs, p, st, rope, cos, sin)
                    t[masked] += time.perf_counter() - t0
                    cpu[masked] += time.process_time() - c0
                    heads[masked] = seen[-1]
                st = outs[False][1]
                a, b = heads[True], heads[False]
                worst = max(worst, (a - b).abs().max().item() / a.abs().max().item())
        print(f"{n:>6} tokens: layer forward masked {t[True]:7.2f} s, selected {t[False]:7.2f} s "
              f"({t[True] / t[False]:.2f}x); CPU time {cpu[True]:.1f} s, {cpu[False]:.1f} s "
              f"({cpu[True] / cpu[False]:.2f}x); heads' outputs' max abs difference {worst:.1e} of "
              f"their max; load avg {load()}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
