"""DeepSeek-V4 at long context: which engine moves, ours or llama.cpp? (Not collected by pytest.)

    FT_LLAMA_CPP_SRC=.../vendor/llama.cpp PYTHONPATH=... .venv/bin/python \\
        tests/bench/diag_v4_long_context.py [--lengths 2048,8192,16384] [--hf-max 8192]

bench_v4_prefill.py's 1-layer V4-Flash-width model disagreed with llama.cpp on the first token
at 16k prompt tokens (llama.cpp's margin 0.20), not at 2k or 8k. This builds a NARROW model
with the same long-context geometry (one CSA layer: window 128, compress rates 4 / 128, the
indexer's top-512 of the 4096 entries at 16k, 16 indexer heads; a hash-routed MoE; hc_mult 4)
but hidden 256, 4 heads x 256, so every engine runs 16k in minutes, in fp32: transformers'
checkpoint (seeded, perturbed as the tests' tiny models) in the release layout, converted by
llama.cpp's own converter to an F32 GGUF (MXFP4 experts). On that one file, the last prompt
position's logits of:

  * ours (the F32 file, the MXFP4 experts in their blocks; chunked prefill of 512),
  * llama.cpp with an F32 KV cache, and with its default F16 KV cache (n_ubatch 512),
  * transformers' full forward on the file's weights (its experts dequantized from the file),
    up to --hf-max tokens (its eager attention holds [heads, T, T + T / 4] scores); ours is
    then also run with the experts dequantized (fp32 throughout) for that comparison,

and max |difference| and top-1 (with the reference's top-1 - top-2 margin) between each pair.

--selection: instead, how often F16 rounding of the indexer's queries and keys (llama.cpp's
default F16 cache; its F16 matrix product rounds the query to F16 too) changes our top-k: our
prefill with the indexer's scores of the last chunk's 512 queries also computed from F16-rounded
q and keys, the two top-512 sets compared per query.

Measured 2026-12-06 (AMD EPYC Zen 3, 2 threads, a shared machine, load 12-17):

    tokens  ours vs llama.cpp  llama.cpp F16 vs   ours (dequantized)  F16 indexer: entries of
            (F32 KV cache)     F32 KV cache       vs transformers     the top-512 swapped
     2048       2.3e-3             2.2e-2             3.3e-6             -  (all 512 chosen)
     4096         -                  -                  -             0.09 a query (max 1)
     8192       9.6e-3             2.9e-2             5.5e-6          0.12 a query (max 1)
    16384       1.8e-3             3.2e-2           (not run)         0.13 a query (max 2)

(max |difference| of the last position's logits; top-1 the same in every pair at 8192 and
16384, llama.cpp's margin 0.69 and 0.12; at 2048 the top two are within 0.01 and flip between
any two runs.) Ours follows transformers' fp32 forward to 5.5e-6 at 8k (16k: its eager
attention's [4, 16k, 20k] scores did not fit beside the other sessions). Ours and llama.cpp on
the same F32 file with an F32 KV cache stay within 1e-2 up to 16k; llama.cpp's default F16 KV
cache moves its own logits 3-18x further than that, growing with the length, and swaps one or
two of the 512 chosen entries for about one query in eight. So the first-token disagreement
at 16k of the wide Q8_0 model (llama.cpp's margin 0.20) points at llama.cpp's F16 cache (with
both engines' int8 activations), not at our long-context arithmetic; not confirmed on the wide
file itself (llama.cpp with an F32 cache at 16k there is ~700 s of CPU, over an hour of wall
clock on this shared machine).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

NARROW = dict(
    hidden_size=256,
    num_attention_heads=4,
    head_dim=256,  # not index_head_dim: llama.cpp then rotates a 0-layer HCA cache (SIGFPE)
    partial_rotary_factor=0.25,  # rope 64 as released
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=64,
    num_hidden_layers=1,
    layer_types=["compressed_sparse_attention"],
    mlp_layer_types=["hash_moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=128,
    index_n_heads=16,
    index_head_dim=128,
    index_topk=512,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    hc_mult=4,
    swiglu_limit=10.0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    max_position_embeddings=65536,
)


def build(work: Path):
    """(transformers model on the file's weights, the F32 GGUF), built once into ``work``."""
    # deferred: the converter test's fixture code needs FT_LLAMA_CPP_SRC and llama_cpp
    import test_gguf_llamacpp_convert_slow as conv
    from gguf_files import dequantized_reference
    from tiny_models import make_tiny

    hf_dir, f32 = work / "hf", work / "v4-narrow-F32.gguf"
    over = {k: v for k, v in NARROW.items() if v is not None}
    if not f32.exists():
        hf_dir.mkdir(parents=True, exist_ok=True)
        vocab = conv._tokenizer(hf_dir, "deepseek_v4")
        make_tiny("deepseek_v4", hf_dir, seed=3, vocab_size=vocab, **over)
        conv._tokenizer(hf_dir, "deepseek_v4")
        conv._v4_release(hf_dir, work / "release")
        conv._convert(work / "release", f32)
    import transformers as tf

    hf = tf.DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    dequantized_reference("deepseek_v4", hf, f32)
    return hf, f32


def prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(2, 50000, (n,), generator=g).tolist()


def ours_last(path: Path, ids: list[int], dequantized: bool) -> torch.Tensor:
    """Our last-position logits, the prompt fed in chunks of 512 (the engine's prefill)."""
    from freetokend import LLM
    from freetokend.engine.runner import Work
    from freetokend.models import gguf_experts

    saved = gguf_experts.block_expert_format
    if dequantized:
        gguf_experts.block_expert_format = lambda *a: None
    try:
        llm = LLM(path, max_model_len=len(ids) + 64, kv_tokens=len(ids) + 64, dtype="float32")
    finally:
        gguf_experts.block_expert_format = saved
    runner = llm.runner
    st = runner.new_state()
    with torch.no_grad():
        for p in range(0, len(ids), 512):
            chunk = ids[p : p + 512]
            out = runner.forward([Work(st, chunk, want_logits=p + 512 >= len(ids))])
    runner.release(st)
    return runner.placement.fetch(out).float().reshape(-1)[-llm.config.vocab_size :]


def llama_last(path: Path, ids: list[int], f32_cache: bool) -> torch.Tensor:
    import llama_cpp

    kw = dict(type_k=0, type_v=0) if f32_cache else {}  # GGML_TYPE_F32; default F16
    m = llama_cpp.Llama(str(path), n_ctx=len(ids) + 64, n_batch=2048, n_ubatch=512,
                        n_threads=2, n_threads_batch=2, verbose=False, **kw)  # fmt: skip
    m.eval(ids)
    row = np.ctypeslib.as_array(m._ctx.get_logits(), shape=(m.n_vocab(),)).copy()
    m.close()
    return torch.from_numpy(row)


def hf_last(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids]), logits_to_keep=1, use_cache=False).logits[0, -1].float()


def line(a: str, b: str, x: torch.Tensor, ref: torch.Tensor) -> str:
    top2 = ref.topk(2).values
    same = int(x.argmax()) == int(ref.argmax())
    return (f"    {a:<24} vs {b:<24} max |d| {(x - ref).abs().max().item():.2e}  top-1 "
            f"{'same' if same else 'DIFFERS'} (ref margin {(top2[0] - top2[1]).item():.3f}, "
            f"|d| at ref top-1 {(x - ref)[int(ref.argmax())].abs().item():.2e})")  # fmt: skip


def selection(path: Path, lengths: list[int]) -> None:
    """--selection: our top-512 against the one F16-rounded q and keys choose (docstring)."""
    from freetokend import LLM
    from freetokend.engine.runner import Work
    from freetokend.models.layers import compressed as comp

    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    record = [False]
    exact = comp.index_scores

    def both(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        s = exact(q, keys, w)
        if record[0]:
            pairs.append((s, exact(q.half().float(), keys.half().float(), w)))
        return s

    comp.index_scores = both
    for n in lengths:
        ids, pairs[:] = prompt(n), []
        llm = LLM(path, max_model_len=n + 64, kv_tokens=n + 64, dtype="float32")
        st = llm.runner.new_state()
        with torch.no_grad():
            for p in range(0, n, 512):
                record[0] = p + 512 >= n
                llm.runner.forward([Work(st, ids[p : p + 512], want_logits=record[0])])
        llm.runner.release(st)
        pos = torch.arange(n - sum(a.shape[0] for a, _ in pairs), n)
        hidden = torch.arange(pairs[0][0].shape[1])[None] >= ((pos + 1) // 4)[:, None]
        k = NARROW["index_topk"]
        a, b = (comp.select_topk(torch.cat(x).masked_fill(hidden, -torch.inf), k)
                for x in zip(*pairs, strict=True))  # fmt: skip
        swapped = torch.tensor([len(set(a[i].tolist()) - set(b[i].tolist()) - {-1})
                                for i in range(a.shape[0])], dtype=torch.float)  # fmt: skip
        print(f"{n} tokens, the last {a.shape[0]} queries: F16 swaps {swapped.mean():.2f} of "
              f"the top-{k} a query (max {int(swapped.max())}), queries with a swap "
              f"{(swapped > 0).float().mean():.2f}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192,16384")
    ap.add_argument("--hf-max", type=int, default=8192)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ftbench-v4/narrow"))
    ap.add_argument("--selection", action="store_true", help="F16's effect on the top-k")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    hf, path = build(args.work)
    print(f"model ready in {time.perf_counter() - t0:.0f} s: {path}", flush=True)
    if args.selection:
        selection(path, [int(x) for x in args.lengths.split(",")])
        return
    for n in (int(x) for x in args.lengths.split(",")):
        ids = prompt(n)
        r: dict[str, torch.Tensor] = {}
        runs = [
            ("ours (MXFP4 blocks)", partial(ours_last, path, ids, False)),
            ("llama.cpp F32 cache", partial(llama_last, path, ids, True)),
            ("llama.cpp F16 cache", partial(llama_last, path, ids, False)),
        ]
        if n <= args.hf_max:
            runs += [
                ("ours (dequantized)", partial(ours_last, path, ids, True)),
                ("transformers", partial(hf_last, hf, ids)),
            ]
        for name, fn in runs:
            t0 = time.perf_counter()
            r[name] = fn()
            print(f"  {n}: {name} {time.perf_counter() - t0:.0f} s", flush=True)
        print(f"{n} tokens:")
        pairs = [("ours (MXFP4 blocks)", "llama.cpp F32 cache"),
                 ("ours (MXFP4 blocks)", "llama.cpp F16 cache"),
                 ("llama.cpp F16 cache", "llama.cpp F32 cache"),
                 ("ours (dequantized)", "transformers"),
                 ("ours (MXFP4 blocks)", "ours (dequantized)")]  # fmt: skip
        for a, b in pairs:
            if a in r and b in r:
                print(line(a, b, r[a], r[b]), flush=True)
        torch.save(r, args.work / f"logits-{n}.pt")


if __name__ == "__main__":
    main()
