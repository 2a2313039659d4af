"""DeepSeek-V4 prefill against llama.cpp on the same GGUF file (issue 42's benchmark line: "prefill
of 16k tokens against llama.cpp on the same GGUF"). (Not collected by pytest.)

    FT_LLAMA_CPP_SRC=.../vendor/llama.cpp PYTHONPATH=... .venv/bin/python \
        tests/bench/bench_v4_prefill.py [--lengths 2048,8192,16384] [--reps 2] [--gen 8]
        [--threads 2] [--layers 2|1] [--profile] [--flash-attn]

The model: DeepSeek-V4-Flash's geometry from transformers' ``DeepseekV4Config()`` defaults
(hidden 4096, 64 heads x 512 on one KV head, rope 64, q_lora 1024, o_groups 8 x o_lora 1024,
window 128, indexer 64 heads x 128 with index_topk 512, hc_mult 4, compress rates 4 / 128,
routed experts of 2048 with 6 of them a token, one shared expert, the SwiGLU clamp, the
sqrtsoftplus router) but few layers: by default (--layers 2) one of each compressed kind as the
release orders them, layer 0 HCA (rate 128) with a hash-routed MoE, layer 1 CSA (rate 4, the
Lightning Indexer) with a routed MoE; --layers 1: the CSA layer alone, with the hash-routed MoE
(the long-context costs, the indexer's above all, are CSA's; half the time on a busy
machine); 16 routed experts instead of 256; GPT-2's 50257-token vocabulary (the only
tokenizer llama.cpp's converter accepts offline, tests/bench/decode_tokenizer.py). Random
weights: transformers' own initialisation in bf16 plus tests/tiny_models.perturb (norms,
router bias, the compressors' position biases, the hash table).

The file: that checkpoint rewritten into the release layout (FP4 routed experts with ue8m0
scales, the legacy config keys; tests/test_gguf_llamacpp_convert_slow.py's fixture code),
converted by llama.cpp's own ``convert_hf_to_gguf.py`` (``FT_LLAMA_CPP_SRC``) to F32 (the
experts repacked to MXFP4), then ``llama_model_quantize`` to Q8_0 with the MXFP4 experts kept
as released: Q8_0 dense (the hyper-connection and position-bias tables too, as llama.cpp's
quantizer chose), MXFP4 experts, F32 norms, a BF16 router. Cached under --cache (1.2 GB for 2
layers; the intermediate files are deleted; about 10 minutes to build on a busy 2-core machine,
most of it the FP4 rounding of the experts). Both engines load that one file; our load keeps
the Q8_0 blocks (native integer-dot kernels) and the MXFP4 experts packed, and widens the
grouped output projection (``o_a``, to bf16) and the small tables.

The engines, both on the same threads: llama.cpp through llama-cpp-python (its defaults:
n_batch 2048, n_ubatch 512, flash attention off as llama-cpp-python's default has it,
--flash-attn on; F16 KV cache),
freetokend's ``LLM`` on the ``cpu`` backend with its default chunked prefill (prefix cache
off, so a repeated prompt is prefilled again). The prompts are token ids (the same ids for
both, random in [2, 50000), seeded per length).

Measured per length, the engines interleaved (their order alternating rep by rep), medians over
--reps (the longest length once when --reps-longest 1): time to first token (the prompt's
prefill and the first greedy token's sampling) and prefill tok/s (prompt tokens / TTFT), per
engine, and ours over llama.cpp. Then --gen greedy tokens each: llama.cpp is teacher-forced on
our generated tokens (when ours ran before it), so its top-1 at every step is compared with
ours, with llama.cpp's top-1 - top-2 margin reported (random weights over a 50k vocabulary:
small margins flip under either engine's int8 activations; the margin says how decisive a
disagreement is).

--profile: our prefills timed by part as they run (attention and its projections,
compressors, indexer scores and top-k, hyper-connections, experts: wall clock of their calls,
by wrapping the modules' forwards; the last run of each length reported).

Measured 2026-12-06 (AMD EPYC Zen 3, AVX2, 2 threads each; the machine shared with five other
sessions, load average 11-15 on its 2 cores for most of it, so every figure is slowed ~5x and
noisy). TTFT (tok/s):
    2 layers,  2048 tokens (before the o_a fix below)  ours 272 s (7.5)   llama.cpp 287 s (7.1)
    1 layer,   2048 tokens, interleaved                ours 180 s (11.4)  llama.cpp 195 s (10.5)
    1 layer,  16384 tokens, --only side by side        ours 1900 s (8.6)  llama.cpp 2209 s (7.4)
      (process CPU time 384 s against 685 s, llama.cpp's including its threads' spinning; the
      load fell from ~14 to ~5 during llama.cpp's last 10 minutes, which favours it)
    1 layer,   2048 tokens, interleaved, load ~3.5    ours 33.0 s (62.0) llama.cpp 46.7 s (43.9)
    1 layer,   8192 tokens, interleaved, load ~4.5    ours 154.5 s (53.0) llama.cpp 259.8 s (31.5)
Greedy agreement: 2 layers at 2048, 8/8 (llama.cpp's margins median 0.28, min 0.03); 1 layer at
2048, 7/8 (the one differing at a margin of 0.035, a near tie); at 8192, 8/8 (margins median
0.20, min 0.11); 1 layer at 16384 the first
token already differs, with llama.cpp's margin 0.20 there (not a near tie). Diagnosed on a
narrow model of the same geometry (diag_v4_long_context.py): ours follows transformers' fp32
forward at long context (5.5e-6 at 8k) and llama.cpp with an F32 KV cache (within 1e-2 up to
16k), while llama.cpp's default F16 KV cache, which this benchmark runs, moves its logits 3-18x
further and swaps boundary entries of the indexer's top-512: the disagreement points at
llama.cpp's F16 cache (not confirmed on this file: ~700 s of llama.cpp CPU at 16k).
Our 16k prefill by part (--profile): the CSA layer's attention 77 % of which the indexer 15 %
(its scores 10.5 %, top-k sort 0.9 %), o_a / o_b 10.7 %, q_b 4.8 %, compressors 3.3 %, and the
rest, about 44 % of the prefill, the attention proper: the torch prefill path scores every
query against the window and ALL compressed entries (masked to the selected 512), 8x the
selected rows at 16k; the MoE 17.5 %, hyper-connections 4.6 %. Before the o_a fix a 64-token
prefill spent 36 % in o_a / o_b (torch's bf16 einsum for o_a).

The machine is shared in our sandbox: figures move between runs; the load average is printed
with each measurement; ratios within a rep are the ones to read. Name the CPU beside any figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

# DeepseekV4Config() defaults but these (--layers): 2 = HCA + hash MoE, CSA + MoE; 1 = CSA +
# hash MoE (the long-context costs, the indexer's above all, are the CSA layer's)
CONFIGS = {
    2: dict(
        num_hidden_layers=2,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"],
        n_routed_experts=16,
    ),
    1: dict(
        num_hidden_layers=1,
        layer_types=["compressed_sparse_attention"],
        mlp_layer_types=["hash_moe"],
        n_routed_experts=16,
    ),
}
BUILD = 1  # bump when the checkpoint's recipe changes


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---- the file ----------------------------------------------------------------------------------


def build_gguf(cache: Path, layers: int) -> Path:
    """The mid model's Q8_0 + MXFP4 GGUF by llama.cpp's converter and quantizer (cached)."""
    config = CONFIGS[layers]
    out = cache / f"v4flash-{layers}L-16e-q8_0-mxfp4.gguf"
    stamp = {"build": BUILD, "config": config, "src": os.environ.get("FT_LLAMA_CPP_SRC")}
    stamp_path = out.with_suffix(".stamp.json")
    if out.exists() and stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        return out
    # deferred: the converter test's fixture code needs FT_LLAMA_CPP_SRC and llama_cpp
    import test_gguf_llamacpp_convert_slow as conv
    import transformers as tf
    from tiny_models import perturb

    work = cache / f"build-{layers}"
    shutil.rmtree(work, ignore_errors=True)
    hf_dir = work / "hf"
    hf_dir.mkdir(parents=True)
    vocab = conv._tokenizer(hf_dir, "deepseek_v4")
    cfg = tf.DeepseekV4Config(**config, vocab_size=vocab)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 1.5 B parameters: built in bf16
    try:
        model = tf.DeepseekV4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    perturb(model, 1)
    model.save_pretrained(hf_dir)
    del model
    conv._tokenizer(hf_dir, "deepseek_v4")  # save_pretrained may have written its own
    print(f"checkpoint built in {time.perf_counter() - t0:.0f} s", flush=True)
    conv._v4_release(hf_dir, work / "release")
    shutil.rmtree(hf_dir)
    f32 = conv._convert(work / "release", work / "v4-F32.gguf")
    shutil.rmtree(work / "release")
    tmp = conv._quantize(f32, work / "v4-Q8_0.gguf", keep_mxfp4_experts=True)
    tmp.rename(out)
    shutil.rmtree(work)
    stamp_path.write_text(json.dumps(stamp))
    print(f"GGUF written in {time.perf_counter() - t0:.0f} s: {out}", flush=True)
    return out


# ---- the engines ----------------------------------------------------------------------------


class Llama:
    name = "llama.cpp"

    def __init__(self, path: Path, n_ctx: int, threads: int, flash_attn: bool) -> None:
        # deferred: llama_cpp is optional (this benchmark alone needs it)
        import llama_cpp

        self.m = llama_cpp.Llama(
            str(path), n_ctx=n_ctx, n_batch=2048, n_ubatch=512, n_threads=threads,
            n_threads_batch=threads, flash_attn=flash_attn, verbose=False,
        )  # fmt: skip
        self.vocab = self.m.n_vocab()

    def _logits(self) -> np.ndarray:
        ptr = self.m._ctx.get_logits()  # the batch's one output row (logits_all off)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,)).copy()

    def run(self, ids: list[int], gen: int, forced: list[int] | None):
        """-> (TTFT s, greedy/forced tokens, per step (top-1, margin, logit of forced))."""
        self.m.reset()
        t0 = time.perf_counter()
        self.m.eval(ids)
        row = self._logits()
        first = int(row.argmax())
        ttft = time.perf_counter() - t0
        steps, toks = [], []
        for i in range(gen):
            if i:
                self.m.eval([toks[-1]])
                row = self._logits()
            top2 = np.partition(row, -2)[-2:]
            top = int(row.argmax()) if i else first
            nxt = forced[i] if forced and i < len(forced) else top
            steps.append((top, float(top2[1] - top2[0]), float(row[top] - row[nxt])))
            toks.append(nxt)
        return ttft, toks, steps


class Ours:
    name = "freetokend"

    def __init__(self, path: Path, max_len: int) -> None:
        from freetokend import LLM

        self.llm = LLM(path, "cpu", max_model_len=max_len, kv_tokens=max_len, prefix_cache=False)
        self.n = 0
        self.profiler: Profiler | None = None
        self.profiles: dict[int, str] = {}

    def run(self, ids: list[int], gen: int, forced: list[int] | None):
        from freetokend.engine.core import NO_TOKEN
        from freetokend.engine.sampler import SamplingParams

        eng = self.llm.engine
        self.n += 1
        params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
        prof = self.profiler or contextlib.nullcontext()
        t0 = time.perf_counter()
        eng.add_request(f"bench-{self.n}", list(ids), params)
        out: list[int] = []
        ttft = 0.0
        with prof:
            while not out:  # the prefill and the first token
                out += [o.token_id for o in eng.step() if o.token_id != NO_TOKEN]
        ttft = time.perf_counter() - t0
        if self.profiler is not None:
            self.profiles[len(ids)] = self.profiler.report(len(ids), ttft)
        while eng.has_unfinished():
            out += [o.token_id for o in eng.step() if o.token_id != NO_TOKEN]
        return ttft, out, None


# ---- the comparison ----------------------------------------------------------------------------


def prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(2, 50000, (n,), generator=g).tolist()


def compare(args, path: Path) -> None:
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + args.gen + 64
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ours = Ours(path, max_len)
    t_ours = time.perf_counter() - t0
    if args.profile:
        ours.profiler = Profiler(ours.llm.model)
    t0 = time.perf_counter()
    llama = Llama(path, max_len, args.threads, args.flash_attn)
    t_llama = time.perf_counter() - t0
    print(f"loaded: freetokend {t_ours:.1f} s (MoE {ours.llm.banks.format}), llama.cpp "
          f"{t_llama:.1f} s", flush=True)  # fmt: skip
    ttft: dict[tuple[str, int], list[float]] = defaultdict(list)
    our_tokens: dict[int, list[int]] = {}
    steps: dict[int, list] = {}
    for rep in range(args.reps):
        for n in lengths:
            if rep >= args.reps_longest and n == max(lengths) and len(lengths) > 1:
                continue
            ids = prompt(n)
            order = (ours, llama) if rep % 2 == 0 else (llama, ours)
            for eng in order:
                forced = our_tokens.get(n) if eng is llama else None
                t, toks, st = eng.run(ids, args.gen, forced)
                ttft[eng.name, n].append(t)
                if eng is ours:
                    our_tokens[n] = toks
                elif forced is not None:
                    steps[n] = st
                print(f"  rep {rep} {n:>6} {eng.name:>10}: TTFT {t:7.2f} s "
                      f"({n / t:7.1f} tok/s), load avg {load()}", flush=True)  # fmt: skip
    kinds = {2: "2 layers (HCA + hash MoE, CSA + MoE)", 1: "1 layer (CSA + hash MoE)"}
    print(f"\nDeepSeek-V4-Flash geometry, {kinds[args.layers]}, 16 experts; "
          f"Q8_0 dense + MXFP4 experts; {cpu_name()}, {args.threads} threads; shared machine "
          f"(load average {load()} at the end)")  # fmt: skip
    print(f"{'prompt':>7} {'llama TTFT s':>13} {'tok/s':>8} {'ours TTFT s':>12} {'tok/s':>8} "
          f"{'ours/llama tok/s':>17} {'runs':>5}")  # fmt: skip
    for n in lengths:
        a, b = statistics.median(ttft[llama.name, n]), statistics.median(ttft[ours.name, n])
        print(f"{n:>7} {a:13.2f} {n / a:8.1f} {b:12.2f} {n / b:8.1f} {a / b:17.2f} "
              f"{len(ttft[ours.name, n]):>5}")  # fmt: skip
    print("\ngreedy agreement (llama.cpp teacher-forced on our tokens; margin: its top-1 - top-2)")
    for n in lengths:
        st = steps.get(n)
        if st is None:
            print(f"{n:>7}: no llama.cpp run after ours")
            continue
        toks = our_tokens[n]
        agree = [top == t for (top, _, _), t in zip(st, toks, strict=True)]
        margins = [m for _, m, _ in st]
        behind = [d for (_, _, d), a in zip(st, agree, strict=True) if not a]
        print(f"{n:>7}: top-1 {sum(agree)}/{len(agree)}; llama.cpp margins median "
              f"{statistics.median(margins):.3f}, min {min(margins):.3f}"
              + (f"; where they differ our token is {', '.join(f'{d:.3f}' for d in behind)} "
                 f"below llama.cpp's top-1 in its logits" if behind else ""))  # fmt: skip
    for n in lengths:
        if n in ours.profiles:
            print("\n" + ours.profiles[n])


def single(args, path: Path) -> None:
    """--only: one engine, each length once in order; TTFT, the process's CPU time over the
    prefill (both threads), the greedy tokens (and llama.cpp's margins) printed for a
    comparison with the other engine's run (started beside it, so both see the same load)."""
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + args.gen + 64
    torch.set_num_threads(args.threads)
    if args.only == "ours":
        eng: Ours | Llama = Ours(path, max_len)
        if args.profile:
            eng.profiler = Profiler(eng.llm.model)
    else:
        eng = Llama(path, max_len, args.threads, args.flash_attn)
    for n in lengths:
        c0 = time.process_time()
        t, toks, st = eng.run(prompt(n), args.gen, None)
        cpu = time.process_time() - c0  # the greedy tokens after the first included (few)
        print(f"{n:>6} {eng.name:>10}: TTFT {t:7.2f} s ({n / t:7.1f} tok/s), CPU {cpu:7.1f} s "
              f"with the {args.gen} tokens, load avg {load()}; tokens {toks}", flush=True)  # fmt: skip
        if st is not None:
            print(f"        llama.cpp margins (top-1 - top-2) {[round(m, 3) for _, m, _ in st]}")
        if isinstance(eng, Ours) and n in eng.profiles:
            print(eng.profiles[n], flush=True)


# ---- the profile ------------------------------------------------------------------------------


class Profiler:
    """Wall clock of the V4 layers' parts during one of our prefills, by wrapping their
    modules' forwards and the module functions they call (nested parts are listed apart and
    counted inside their parents too)."""

    def __init__(self, model) -> None:
        from freetokend.models import deepseek_v4_model
        from freetokend.models.layers import compressed, v4_attention

        self.points = profile_points(model, deepseek_v4_model, compressed, v4_attention)
        self.times: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.saved: list = []

    def __enter__(self) -> Profiler:
        self.times.clear()
        self.calls.clear()
        for owner, attr, label in self.points:
            fn = getattr(owner, attr)
            self.saved.append((owner, attr, fn))
            setattr(owner, attr, self._timed(fn, label))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self.saved):
            setattr(owner, attr, fn)
        self.saved.clear()

    def _timed(self, fn, label: str):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.times[label] += time.perf_counter() - t0
                self.calls[label] += 1

        return timed

    def report(self, n: int, total: float) -> str:
        lines = [f"profile: our prefill of {n} tokens (TTFT {total:.2f} s), by part"]
        for label, t in sorted(self.times.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {label:<44} {t:8.2f} s {100 * t / total:5.1f} %  "
                         f"({self.calls[label]} calls)")  # fmt: skip
        return "\n".join(lines)


def profile_points(model, v4_model, compressed, v4_attention):
    """(object, attribute, label) for every part to time: modules' forwards (instance
    attributes, which ``nn.Module.__call__`` reads) and the module-level functions the layers
    call through their modules."""
    points = [
        (v4_attention, "project", "  attention: q_a / kv projections"),
        (compressed, "index_scores", "    indexer: scores (q . k, relu, weights)"),
        (compressed, "select_topk", "    indexer: top-k (sort)"),
        (v4_model, "merge_streams", "hyper-connections: merge"),
        (model.hc_head, "forward", "hyper head"),
        (model.lm_head, "forward", "lm head"),
    ]
    for i, la in enumerate(model._layers):
        att = la.self_attn
        kind = "CSA" if att.indexer is not None else "HCA" if att.compressor else "sliding"
        points += [
            (att, "forward", f"L{i} {kind} attention (all of it)"),
            (att.q_b_proj, "forward", "  attention: q_b projection"),
            (att.o_a_proj, "forward", "  attention: o_a / o_b projections"),
            (att.o_b_proj, "forward", "  attention: o_a / o_b projections"),
            (la.attn_hc, "forward", "hyper-connections: mixes"),
            (la.ffn_hc, "forward", "hyper-connections: mixes"),
            (la.mlp, "forward", f"L{i} MoE (router, shared + routed experts)"),
            (la.mlp.shared_expert, "forward", f"  L{i} MoE: shared expert"),
        ]
        if att.compressor is not None:
            points.append((att.compressor, "forward", f"  L{i} compressor"))
        if att.indexer is not None:
            ix = att.indexer
            points += [
                (ix, "forward", f"  L{i} indexer (all of it)"),
                (ix.compressor, "forward", f"    L{i} indexer: its compressor"),
                (ix.q_b_proj, "forward", f"    L{i} indexer: q_b projection"),
            ]
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192,16384")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--reps-longest", type=int, default=1, help="reps of the longest length")
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/ftbench-v4"))
    ap.add_argument("--profile", action="store_true", help="our prefills timed by part")
    ap.add_argument("--layers", type=int, choices=sorted(CONFIGS), default=2)
    ap.add_argument("--no-compare", action="store_true")
    ap.add_argument("--only", choices=("ours", "llama"), help="one engine (run two side by side)")
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp with flash attention")
    args = ap.parse_args()
    if not (
        Path(os.environ.get("FT_LLAMA_CPP_SRC", "/nonexistent")) / "convert_hf_to_gguf.py"
    ).exists():
        raise SystemExit("FT_LLAMA_CPP_SRC: the llama.cpp sources with convert_hf_to_gguf.py")
    args.cache.mkdir(parents=True, exist_ok=True)
    path = build_gguf(args.cache, args.layers)
    if args.only:
        single(args, path)
    elif not args.no_compare:
        compare(args, path)


if __name__ == "__main__":
    main()
