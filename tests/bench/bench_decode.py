"""CPU decode benchmark: freetoken's `cpu` MoE backend vs HF transformers vs llama.cpp.

    PYTHONPATH=/tmp/ftpath .venv/bin/python tests/bench/bench_decode.py [--engines ...] [--threads 2]

In one run: builds (cached under /tmp/ftbench_decode) a random bf16 Qwen3MoeForCausalLM with
Qwen3-30B-A3B layer geometry (decode_ckpt.py), converts it to GGUF BF16 with the converter from
the installed llama-cpp-python's source distribution (decode_llama.py), measures the machine's
memory-read bandwidth, then each engine's batch-1 decode and 512-token prefill speed, each in a
fresh subprocess with the same thread count (decode_workers.py), and prints one table with each
engine's fraction of the decode roofline (read bandwidth / weight bytes read per token). Every
round measures the read bandwidth again before its engines (a shared machine's moves by up to 2x
between minutes) and an engine's roofline fraction is the median over its rounds of its speed
against that round's bandwidth; each (ours, peer) line gives the decode ratio of the medians and
the median of the rounds' paired ratios (the two engines ran minutes apart in each round).
Every decode repeat also carries the read bandwidth measured just before and after it, and a last
block of lines compares each pair within the slow and the fast level of the machine's bandwidth
(decode_report.spell_lines): a shared VM's moves between two levels, so engines measured minutes
apart can differ by the machine alone.
The quantized rows (see ENGINES) pair ours with llama.cpp's at about the same bytes per token,
measured for both engines from the loaded tensors (llama.cpp's from its file); the
"freetoken-gguf-*" rows load llama.cpp's own quantized file, the same bytes. Each pair's line
compares the greedy tokens of one prompt and, on the same input, each engine's logits of another
position by position (top-1 equal, how many of the rest are near ties, the relative difference):
greedy tokens part for good at the first near tie, and this random model's logits are flat
(the top two of a position are often within 0.01), so that count alone says little.

Peers that are not installed (transformers, llama-cpp-python) are skipped; none is a project
dependency. llama.cpp, opt-in, built from source (~6+ min on 2 cores; the converter also wants
the `gguf` package):
    .venv/bin/pip install gguf && .venv/bin/pip install llama-cpp-python --no-binary :all:
On a CPU with AMX (Sapphire Rapids and later) llama-cpp-python 0.3.36's native build repacks
Q4_K weights for its AMX kernels and segfaults on the first Q4_K_M decode here (the row reads
"worker killed by SIGSEGV"; ggml-org/llama.cpp#20824 is the same crash); build it without AMX,
keeping its AVX-512 paths, for a peer that runs:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON \
      -DGGML_F16C=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" .venv/bin/pip install --force-reinstall \
      --no-deps llama-cpp-python --no-binary :all:
On a CPU with AVX-512, `--isa avx2` runs every freetoken kernel on its AVX2 path, as on a laptop
or desktop without AVX-512; the llama.cpp rows then want a build without AVX-512 too (`--target`
keeps it beside the installed one; `--llama-path` puts it first for those rows):
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF" .venv/bin/pip install --no-cache-dir \
      --no-deps --target /tmp/llama_avx2 llama-cpp-python==0.3.36 --no-binary :all:
(--no-cache-dir: pip's cache would hand back the wheel built earlier, whatever CMAKE_ARGS say)
    ... bench_decode.py --isa avx2 --llama-path /tmp/llama_avx2 --engines freetoken llama.cpp ...
Decode after a short prompt (16 tokens, the default) is nearly all weight reads; an agent's turn
decodes after thousands of tokens of context, where attention over the KV pages is a large part
of each step: `--prompt-tokens 3000 --decode-tokens 32 --prefill-tokens 64` measures that.
From other code: `run_decode_benchmark(...)` returns the rows and prints nothing unless asked.
Each engine runs with both OpenMP wait policies and keeps its better one per round (see _measure);
figures are medians of the repeats within a run and of the rounds across runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the helpers beside this script, also when imported as a module
    sys.path.insert(0, str(HERE))

from decode_ckpt import Geometry, build_checkpoint  # noqa: E402
from decode_llama import (  # noqa: E402
    convert_to_gguf,
    gguf_bytes_per_token,
    gpt2_vocab,
    installed_version,
    llama_source,
    quantize_gguf,
)
from decode_report import Report, Row, median_row  # noqa: E402

CACHE = Path("/tmp/ftbench_decode")
# Rows, by precision (each pair reads about the same bytes per token; MB/token is measured):
#   freetoken / llama.cpp / hf      the BF16 checkpoint (llama.cpp: the converter's BF16 GGUF)
#   *-mxfp4    routed experts MXFP4, the rest BF16: ours quantized at load (quantize_experts),
#              llama.cpp's by its own quantizer (MXFP4_MOE, non-expert tensors kept BF16)
#   *-q8_0, *-q4_k_m, *-q5_k_m   llama.cpp: its quantizer's preset on the BF16 GGUF (what users
#              download; q5_k_m: llama.cpp's file only, no preset of ours);
#              freetoken: our `quantize` preset of the BF16 checkpoint (models/dense_quant.py)
#   freetoken-gguf-*   freetoken loading llama.cpp's quantized file itself: the same file, so
#              the same bytes (quant types without a native kernel are dequantized at load;
#              MXFP4 experts stay in their blocks: block format "mxfp4/mxfp4", integer rows)
#   freetoken-fp32act  the BF16 checkpoint with cpu_bf16_dot off: the fp32-activation kernels
#              (the "freetoken" row takes vdpbf16ps, activations rounded to bf16 as llama.cpp's
#              BF16 path, where the CPU has AVX512-BF16; the same kernels as this row elsewhere)
#   freetoken-q4_k     our experts only in GGUF q4_k blocks (quantize_experts="q4_k", integer
#              dot products: experts/block_executor.py), dense bf16: against "freetoken" it
#              isolates the experts' format
ENGINES = (
    "freetoken",
    "freetoken-fp32act",
    "hf",
    "llama.cpp",
    "freetoken-mxfp4",
    "llama.cpp-mxfp4",
    "freetoken-gguf-mxfp4",
    "freetoken-q8_0",
    "llama.cpp-q8_0",
    "freetoken-gguf-q8_0",
    "freetoken-q4_k_m",
    "llama.cpp-q4_k_m",
    "freetoken-gguf-q4_k_m",
    "llama.cpp-q5_k_m",
    "freetoken-gguf-q5_k_m",
    "freetoken-q4_k",
)
# llama.cpp files quantized from the BF16 GGUF
LLAMA_QUANTS = ("mxfp4", "q8_0", "q4_k_m", "q5_k_m")
_PEER_MODULE = {e: "llama_cpp" for e in ENGINES if e.startswith("llama.cpp")} | {
    "hf": "transformers"
}
MXFP4_BYTES_PER_WEIGHT = 17 / 32  # 32 nibbles and one E8M0 scale a block
# (ours, peer) pairs compared at equal precision
_PAIRS = (
    ("freetoken", "hf"),
    ("freetoken", "llama.cpp"),
    ("freetoken-fp32act", "llama.cpp"),
    ("freetoken-mxfp4", "llama.cpp-mxfp4"),
    ("freetoken-gguf-mxfp4", "llama.cpp-mxfp4"),
    ("freetoken-q8_0", "llama.cpp-q8_0"),
    ("freetoken-gguf-q8_0", "llama.cpp-q8_0"),
    ("freetoken-q4_k_m", "llama.cpp-q4_k_m"),
    ("freetoken-gguf-q4_k_m", "llama.cpp-q4_k_m"),
    ("freetoken-gguf-q5_k_m", "llama.cpp-q5_k_m"),
)


def _worker_kind(engine: str) -> str:
    return "llama.cpp" if engine.startswith("llama.cpp") else engine.split("-")[0]


def _worker(
    kind: str, args: dict[str, object], threads: int, timeout: float, omp_passive: bool = False
) -> dict[str, object]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if kind == "llama.cpp" and args.get("llama_path"):  # another build of llama-cpp-python
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(args["llama_path"]), env.get("PYTHONPATH", "")) if p
        )
    env.pop("OMP_WAIT_POLICY", None)
    if omp_passive:
        env["OMP_WAIT_POLICY"] = "passive"
    proc = subprocess.run(
        [sys.executable, str(HERE / "decode_workers.py"), kind, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    if proc.returncode < 0:  # a crash prints nothing: name the signal
        tail.insert(0, f"worker killed by {_signal_name(-proc.returncode)}")
    raise RuntimeError(f"{kind} worker failed (rc {proc.returncode}): {' | '.join(tail)}")


def _signal_name(num: int) -> str:
    import signal

    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _available(engine: str) -> bool:
    mod = _PEER_MODULE.get(engine)
    return mod is None or importlib.util.find_spec(mod) is not None


def _measure(engine: str, common: dict[str, object], threads: int, omp_variants: bool) -> Row:
    """One engine's row: best decode and best prefill over the OpenMP wait policies tried.

    Every engine here runs OpenMP regions (torch's, llama.cpp's); with spinning waits (the
    default) a busy machine can cost them a scheduler slice per region, passive waits cost a
    wake-up instead, so each engine gets its better one (an idle machine favours the default).
    """
    results = []
    for passive in (False, True) if omp_variants else (False,):
        try:
            kind = _worker_kind(engine)
            results.append((passive, _worker(kind, common, threads, 1800, passive)))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            if not results and not omp_variants:
                return Row(engine, note=str(e)[:200])
    if not results:
        return Row(engine, note="every run failed")
    passive, best = max(results, key=lambda r: float(r[1]["decode_tok_s"]))  # type: ignore[arg-type]
    prefill = float(best["prefill_tok_s"])  # type: ignore[arg-type]
    note = f"load {max(float(r['load']) for _, r in results):.1f}"  # type: ignore[arg-type]
    if omp_variants:
        note += ", OMP wait " + ("passive" if passive else "active")
    if "isa" in best:
        note += f", isa {best['isa']}"
    return Row(engine, float(best["decode_tok_s"]), prefill, note, best)  # type: ignore[arg-type]


def run_decode_benchmark(
    engines: tuple[str, ...] = ENGINES,
    threads: int = 2,
    decode_tokens: int = 64,
    prompt_tokens: int = 16,
    prefill_tokens: int = 512,
    repeats: int = 3,
    cache: Path = CACHE,
    verbose: bool = False,
    omp_variants: bool = True,
    rounds: int = 2,
    experts: int = 128,
    isa: str = "",
    llama_path: str = "",
) -> Report:
    """Builds what is missing, measures, returns the report (prints progress when `verbose`).
    ``isa``: every freetoken kernel on that path ("avx2", "scalar"; "" the CPU's best);
    ``llama_path``: a folder holding another build of llama-cpp-python, for the llama.cpp rows."""
    say = print if verbose else (lambda *_: None)
    needs_gguf = any(e.startswith("llama.cpp") or "gguf" in e for e in engines)
    want_llama = needs_gguf and installed_version() is not None
    src = llama_source(cache) if want_llama else None
    g = Geometry(experts=experts)
    say("checkpoint ...")
    model = build_checkpoint(cache / "mid", gpt2_vocab(src), g)
    gguf = None
    quantized: dict[str, Path] = {}  # llama.cpp's files by LLAMA_QUANTS name
    if want_llama and src is not None:
        say("GGUF conversion ...")
        gguf = convert_to_gguf(model, src, cache / "mid-bf16.gguf")
        for q in LLAMA_QUANTS:
            if any(e.endswith("-" + q) and "llama.cpp" in e or "gguf-" + q in e for e in engines):
                say(f"GGUF {q} quantization (llama.cpp's quantizer) ...")
                quantized[q] = quantize_gguf(gguf, cache / f"mid-{q}.gguf", q)
    common = {
        "model": str(model),
        "threads": threads,
        "vocab": g.vocab,
        "repeats": repeats,
        "decode_tokens": decode_tokens,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": prefill_tokens,
        "gguf": str(gguf) if gguf else None,
        "isa": isa,
        "llama_path": llama_path,
    }

    def read_ceiling() -> float:
        # the machine's read bandwidth moves between rounds on a shared VM (2 threads, huge
        # pages: 34 and 60 GB/s minutes apart), so every round measures its own, beside its
        # engines, and each engine's roofline is taken against its rounds' (Report)
        reads = (
            _worker("membw", {"threads": threads}, threads, 300, passive)["read_bytes_s"]
            for passive in ((False, True) if omp_variants else (False,))
        )
        return max(float(r) for r in reads)  # type: ignore[arg-type]

    # Rounds interleave the engines (A B C A B C ...), so a slow spell of a shared machine
    # hits every engine alike; each reports the median of its rounds.
    variant: dict[str, dict[str, object]] = {
        "freetoken-mxfp4": {"quantize_experts": "mxfp4"},
        "freetoken-fp32act": {"cpu_bf16_dot": False},
        "freetoken-q8_0": {"quantize": "q8_0"},
        "freetoken-q4_k_m": {"quantize": "q4_k_m"},
        "freetoken-q4_k": {"quantize_experts": "q4_k"},
    }
    for q in LLAMA_QUANTS:
        path = str(quantized[q]) if q in quantized else None
        variant[f"llama.cpp-{q}"] = {"gguf": path}
        variant[f"freetoken-gguf-{q}"] = {"gguf": path, "load_gguf": True}
    runs: dict[str, list[Row]] = {e: [] for e in engines}
    (cache / "logits").mkdir(parents=True, exist_ok=True)
    ceilings: list[float] = []
    for r in range(rounds):
        say(f"memory bandwidth (round {r + 1} of {rounds}) ...")
        ceilings.append(read_ceiling())
        for engine in engines:
            args = {**common, **variant.get(engine, {})}
            args["logits_out"] = str(cache / "logits" / f"{engine}.npy")
            needs_file = engine.startswith("llama.cpp") or "gguf" in engine
            if not _available(engine) or (needs_file and not args["gguf"]):
                runs[engine] = [Row(engine, note="not installed: skipped")]
                continue
            say(f"{engine} (round {r + 1} of {rounds}) ...")
            row = _measure(engine, args, threads, omp_variants)
            row.extra["round"] = r
            runs[engine].append(row)
    rows = [median_row(runs[e]) for e in engines]
    ref = next((r.extra.get("greedy") for r in rows if r.engine == "freetoken"), None)
    for row in rows:
        mx = row.engine.endswith("-mxfp4")
        measured = row.extra.get("bytes_per_token")
        file = variant.get(row.engine, common).get("gguf")
        if not measured and row.engine.startswith("llama.cpp") and file:
            measured = gguf_bytes_per_token(Path(str(file)), g.top_k, g.experts)
        row.bytes_per_token = (
            int(measured)  # type: ignore[call-overload]
            if measured
            else g.bytes_per_token(MXFP4_BYTES_PER_WEIGHT if mx else 2.0)
        )
        tokens = row.extra.get("greedy")
        if isinstance(tokens, list) and isinstance(ref, list) and row.engine != "freetoken":
            same = sum(a == b for a, b in zip(tokens, ref, strict=False))
            row.note += f", agree {same}/{len(ref)}"
    return Report(ceilings, g.bytes_per_token(), threads, rows, _PAIRS)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=16,
        help="context before decode (16); thousands for decode as an agent's turn sees it",
    )
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--rounds", type=int, default=2, help="engine rounds, interleaved; medians (2)")
    ap.add_argument(
        "--experts",
        type=int,
        default=128,
        help="routed experts per layer (128: Qwen3-30B-A3B; fewer: a quick run whose dense "
        "share of the bytes per token is larger than the real model's)",
    )
    ap.add_argument(
        "--no-omp-variants",
        action="store_true",
        help="run each engine once with the default OpenMP wait policy (not also with passive)",
    )
    ap.add_argument(
        "--isa",
        default="",
        choices=("", "avx2", "avx512", "scalar"),
        help="run every freetoken kernel on this path, as on a CPU that has no more (avx2: a "
        "laptop or desktop without AVX-512); default: the best this CPU runs",
    )
    ap.add_argument(
        "--llama-path",
        default="",
        help="a folder with another build of llama-cpp-python (pip install --target), put first "
        "on the llama.cpp rows' PYTHONPATH: e.g. an AVX2-only build beside --isa avx2",
    )
    a = ap.parse_args()
    report = run_decode_benchmark(
        tuple(a.engines),
        a.threads,
        a.decode_tokens,
        a.prompt_tokens,
        a.prefill_tokens,
        a.repeats,
        a.cache,
        verbose=True,
        omp_variants=not a.no_omp_variants,
        rounds=a.rounds,
        experts=a.experts,
        isa=a.isa,
        llama_path=a.llama_path,
    )
    print(report.table())


if __name__ == "__main__":
    main()
