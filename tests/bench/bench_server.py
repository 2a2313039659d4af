"""Serving benchmark: `freetokend` against llama.cpp's `llama-server` on the same GGUF file, over
HTTP, as agents use them (issue 44's figures).

    PYTHONPATH=... .venv/bin/python tests/bench/bench_server.py [--threads 2] [--rounds 1]
        [--prompts 2048,8192,32768] [--streams 1,2,4,8] [--itl-prompt 16384] [--quick]
        [--only load|itl|decode|ttft] [--drop-caches] [--ft-budgets 2,0] [--no-llama]
        [--weights q4_k_m|bf16] [--itl-trace DIR]

What it builds (cached under /tmp/ftbench-server):
- the decode benchmark's random Qwen3-30B-A3B-geometry checkpoint (decode_ckpt.py; 4 layers,
  hidden 2048, 128 experts of 768, top-8) declaring a 40960-token context, converted by the
  installed llama-cpp-python's own converter and quantized to Q4_K_M by its quantizer: both
  engines load that one file (``--weights bf16``: the converter's BF16 file before quantizing,
  5.4 GB, instead);
- `llama-server` from the same llama-cpp-python version's vendored llama.cpp (the sdist, the
  `llama-server` target only, web UI off, CPU only, built for this machine), unless
  `--llama-server PATH` names one. About 6 minutes on 2 cores the first time.

What it measures, per engine, in rounds whose engine order alternates (medians over rounds):
- load: spawning the server until /health answers 200 (the daemon's package byte-compiled
  before, as an install leaves it), with the file evicted from the page cache
  first (cold: ``posix_fadvise(DONTNEED)`` on the file, or the whole page cache with
  ``--drop-caches`` as root) and with it read just before (warm);
- time to first token of one streamed /v1/completions request per prompt length (token-id
  prompts: both engines see the same tokens; each prompt is new, so no prefix cache helps; the
  longest prompt only in the first round);
- aggregate decode with 1, 2, 4 and 8 concurrent streams: each a short new prompt and
  ``--decode-tokens`` tokens (``ignore_eos``); the tokens all streams produce while every one of
  them decodes (from the last stream's first token to the first stream's last), per second;
- a decoding stream's inter-token latency while another request brings a ``--itl-prompt``-token
  prompt: its median alone, then its p50, p99 and max from the long request's arrival to that
  request's first token, then its median alone again once that request is done (its context
  has grown meanwhile, and its decode step with it: by thousands of tokens where the prompt is
  paced), with p99 as a multiple of each median (the issue asks p99 <= 3x the stream's
  median), and that long prompt's time to first token;
- greedy agreement on one prompt (16 tokens): how many leading tokens both engines share. Both
  run the same file, but their kernels round differently, and this random model's logits are
  flat, so a short shared prefix is expected; it shows the engines run the same model.

Both servers get the same threads, one shared KV pool big enough for the longest prompt
(llama-server: ``--parallel 8 --kv-unified -c``; freetokend: ``--kv-tokens``, ``--max-model-len``),
and their default batching (llama-server: continuous batching, -b 2048 / -ub 512; freetokend: its
scheduler's token budget, prompt chunks beside decoding streams sized by ``--mixed-step-budget``).
``--ft-budgets 2,0`` runs freetokend once per value of that setting (0: fixed 512-token chunks),
each an engine of its own in the interleaved rounds; ``--no-llama`` leaves llama-server out;
``--only itl`` measures the inter-token latency figure alone, ``--only decode`` the aggregate decode
figures, ``--only ttft`` the time to first token figures (with the greedy check). Streamed events
are counted as tokens: both send one event per token (a byte-level token completing no UTF-8
character may ride with the next; rare here).
The machine is shared in our sandbox: figures move between runs; ratios within a round are the
ones to read. Name the CPU model beside any figure you quote.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from bench_gguf_startup import evict, warm
from decode_ckpt import Geometry, build_checkpoint
from decode_llama import (
    convert_to_gguf,
    download_sdist,
    extract_vendored,
    gpt2_vocab,
    installed_version,
    llama_source,
    quantize_gguf,
)

CACHE = Path("/tmp/ftbench-server")
CONTEXT = 40960
SAFE_IDS = (300, 50000)  # prompt token ids drawn from here: no special or byte-fallback tokens


# ---- what both engines load -------------------------------------------------------------------


def build_file(cache: Path, weights: str = "q4_k_m") -> Path:
    """The file both engines load: the converter's BF16 output (``weights="bf16"``) or its
    Q4_K_M quantization (the default)."""
    src = llama_source(cache)
    if src is None:
        sys.exit("llama-cpp-python is not installed: it converts and quantizes the file")
    model = build_checkpoint(cache / "mid-40k", gpt2_vocab(src), Geometry(max_position=CONTEXT))
    bf16 = convert_to_gguf(model, src, cache / "mid-40k-bf16.gguf")
    if weights == "bf16":
        return bf16
    return quantize_gguf(bf16, cache / "mid-40k-q4_k_m.gguf", "q4_k_m")


def build_llama_server(cache: Path, jobs: int) -> Path:
    """llama-server from the installed llama-cpp-python's vendored llama.cpp (cached)."""
    version = installed_version()
    if version is None:
        sys.exit("llama-cpp-python is not installed: its sdist is the llama.cpp source used")
    out = cache / f"llama-server-{version}"
    binary = out / "bin" / "llama-server"
    if binary.exists():
        return binary
    tree = cache / f"llama.cpp-{version}"
    if not (tree / "CMakeLists.txt").exists():
        tmp = Path(tempfile.mkdtemp(dir=cache))
        extract_vendored(download_sdist(cache, version), tmp, wanted=None)
        tmp.rename(tree)
    flags = {
        "CMAKE_BUILD_TYPE": "Release",
        "GGML_NATIVE": "ON",
        "LLAMA_BUILD_SERVER": "ON",
        "LLAMA_BUILD_TOOLS": "ON",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_UI": "OFF",
        "LLAMA_USE_PREBUILT_UI": "OFF",
        "LLAMA_OPENSSL": "OFF",
        "LLAMA_CURL": "OFF",
    }
    build = cache / f"llama-build-{version}"
    cmake = ["cmake", "-S", str(tree), "-B", str(build), *(f"-D{k}={v}" for k, v in flags.items())]
    print("building llama-server (once; minutes) ...", flush=True)
    subprocess.run(cmake, check=True, capture_output=True)
    target = ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]
    subprocess.run(target, check=True, capture_output=True)
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "bin" / "llama-server", binary)
    return binary


# ---- the servers ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    engine: str
    url: str
    proc: subprocess.Popen[bytes]
    load_s: float
    log: Path

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def compile_daemon() -> None:
    """Byte-compiles the daemon's package once, as installing it does: where
    PYTHONDONTWRITEBYTECODE is set (our sandbox) and the package runs from its source tree,
    every start would otherwise compile its ~250 modules again (~0.3-0.6 s on 2 cores)."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("freetokend")
    if spec is None or spec.origin is None:
        sys.exit("freetokend is not importable (PYTHONPATH)")
    compileall.compile_dir(Path(spec.origin).parent, quiet=1)


def start(engine: str, path: Path, threads: int, llama_server: Path, state: Path) -> Server:
    """``engine``: llama.cpp, freetoken, or freetoken@X (freetokend with --mixed-step-budget X)."""
    port = _free_port()
    log = state / f"{engine}.log"
    env = dict(os.environ)
    if engine.startswith("freetoken"):
        cmd = [
            sys.executable,
            "-c",
            "import sys; from freetokend.cli import main; sys.exit(main())",
            "--model",
            str(path),
        ]
        cmd += ["--port", str(port), "--state-dir", str(state / "ft"), "--admin-socket", "off"]
        cmd += ["--moe-backend", "cpu", "--max-model-len", str(CONTEXT)]
        cmd += ["--kv-tokens", str(CONTEXT + 4096), "--max-batch", "16"]
        if "@" in engine:
            cmd += ["--mixed-step-budget", engine.split("@", 1)[1]]
        env["OMP_NUM_THREADS"] = str(threads)
    else:
        cmd = [str(llama_server), "-m", str(path), "--port", str(port), "-t", str(threads)]
        cmd += ["-tb", str(threads), "-c", str(CONTEXT + 4096), "--parallel", "8", "--kv-unified"]
        cmd += ["--no-webui"]
    # One client for every poll, made before the clock starts: ``httpx.get`` makes a client (and
    # loads the CA bundle into a TLS context) each call, ~36 ms of CPU a poll against ~2 ms with
    # one client (AMD EPYC Zen 3 VM): polling every 50 ms took ~40 % of a core from the server
    # being timed, on a 2-core machine.
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=1.0) as client:
        t0 = time.perf_counter()
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").splitlines()[-15:]
                sys.exit(
                    f"{engine} exited with {proc.returncode} while loading:\n" + "\n".join(tail)
                )
            try:
                if client.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        load_s = time.perf_counter() - t0
    return Server(engine, url, proc, load_s, log)


# ---- requests ---------------------------------------------------------------------------------


@dataclass
class Stream:
    sent: float = 0.0
    events: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    error: Exception | None = None


def prompt_ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(*SAFE_IDS, size=n).tolist()  # type: ignore[no-any-return]


def complete(url: str, ids: list[int], max_tokens: int, out: Stream, stop: threading.Event) -> None:
    """One streamed /v1/completions request; fills ``out`` as events arrive."""
    body = {
        "model": "bench",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out.sent = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600.0) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if stop.is_set():
                return
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                out.prompt_tokens = chunk["usage"].get("prompt_tokens")
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    out.events.append(now)
                    out.text.append(choice["text"])


def _thread(
    url: str, ids: list[int], n: int, out: Stream, stop: threading.Event
) -> threading.Thread:
    def run() -> None:
        try:
            complete(url, ids, n, out, stop)
        except Exception as e:  # noqa: BLE001 -- re-raised by the caller
            out.error = e

    t = threading.Thread(target=run)
    t.start()
    return t


def run_streams(url: str, jobs: list[tuple[list[int], int]]) -> list[Stream]:
    outs = [Stream() for _ in jobs]
    stop = threading.Event()
    threads = [_thread(url, ids, n, out, stop) for (ids, n), out in zip(jobs, outs, strict=True)]
    for t in threads:
        t.join()
    for o in outs:
        if o.error is not None:
            raise o.error
    return outs


def ttft(url: str, seed: int, n: int) -> tuple[float, int | None]:
    (s,) = run_streams(url, [(prompt_ids(seed, n), 1)])
    if not s.events:
        raise RuntimeError(f"{url}: no token for a {n}-token prompt")
    return s.events[0] - s.sent, s.prompt_tokens


def aggregate(url: str, seed: int, streams: int, decode: int) -> float:
    """Tokens per second of all streams together while every one of them decodes: from the
    last stream's first token (the prompts are in) to the first stream's last token."""
    outs = run_streams(url, [(prompt_ids(seed + i, 32), decode) for i in range(streams)])
    t0 = max(o.events[0] for o in outs)
    t1 = min(o.events[-1] for o in outs)
    tokens = sum(sum(1 for t in o.events if t0 < t <= t1) for o in outs)
    return tokens / (t1 - t0)


def itl_during_prefill(
    url: str, seed: int, long_prompt: int, trace: Path | None = None
) -> dict[str, float]:
    """A stream decodes alone for a while, then a long prompt arrives (see the module doc).
    ``trace``: a JSON file for the gaps meanwhile, each with its end's seconds after the long
    prompt was sent (where in the prompt the slow steps fall)."""
    stop = threading.Event()
    a = Stream()
    # long enough to outlast the long prompt's prefill (minutes, paced); stopped below
    ta = _thread(url, prompt_ids(seed, 32), CONTEXT - long_prompt - 256, a, stop)
    while len(a.events) < 24:
        if not ta.is_alive():
            raise RuntimeError(f"{url}: the decoding stream ended early: {a.error}")
        time.sleep(0.01)
    alone = np.diff(a.events[4:24])
    (b,) = run_streams(url, [(prompt_ids(seed + 1, long_prompt), 1)])
    # alone again, at the context the stream has grown to meanwhile (its decode step grows with
    # it: the fair "its median" for the gaps just before)
    end = time.monotonic() + 60
    while sum(1 for t in a.events if t > b.events[-1]) < 24 and time.monotonic() < end:
        if not ta.is_alive():
            break
        time.sleep(0.01)
    stop.set()
    ta.join()
    if not a.events or a.events[-1] < b.events[0]:
        raise RuntimeError(f"{url}: the decoding stream ended before the long prompt's first token")
    after = [t for t in a.events if t > b.events[-1]][4:]
    if len(after) < 2:
        raise RuntimeError(f"{url}: the decoding stream ended right after the long prompt")
    during = [t for t in a.events if b.sent <= t <= b.events[0]]
    ends = [*during, b.events[0]]
    gaps = np.diff([max(e for e in a.events if e < b.sent), *ends])
    if trace is not None:
        rows = [[round(t - b.sent, 4), round(1e3 * g, 2)] for t, g in zip(ends, gaps, strict=True)]
        trace.write_text(json.dumps({"at_s_gap_ms": rows}))
    return {
        "alone_p50_ms": 1e3 * float(np.median(alone)),
        "alone_after_p50_ms": 1e3 * float(np.median(np.diff(after))),
        "during_p50_ms": 1e3 * float(np.median(gaps)),
        "during_p99_ms": 1e3 * float(np.percentile(gaps, 99)),
        "during_max_ms": 1e3 * float(gaps.max()),
        "during_tokens": float(len(during)),
        "long_ttft_s": b.events[0] - b.sent,
    }


def greedy(url: str) -> list[str]:
    (s,) = run_streams(url, [(prompt_ids(7, 32), 16)])
    return s.text


def settle(srv: Server, limit_s: float = 60.0) -> None:
    """Waits out what a freshly started freetokend still does beside its first requests (the
    weights' huge-page collapse, hugepages.py: a second core busy for seconds), so that a
    decode figure taken right after start is not measured against it; one short request
    first warms both engines' first-request paths."""
    greedy(srv.url)
    if not srv.engine.startswith("freetoken"):
        return
    end = time.monotonic() + limit_s
    while "huge pages:" not in srv.log.read_text(errors="replace") and time.monotonic() < end:
        time.sleep(0.2)


# ---- one engine's session ---------------------------------------------------------------------


def session(
    engine: str, path: Path, args: argparse.Namespace, server_bin: Path, first: bool
) -> dict:
    state = Path(tempfile.mkdtemp(prefix=f"ftbench-{engine}-"))
    out: dict = {}
    itl_trace = None
    if args.itl_trace is not None:
        args.itl_trace.mkdir(parents=True, exist_ok=True)
        itl_trace = args.itl_trace / f"{engine}-{int(time.time())}.json"
    try:
        if args.only not in ("itl", "decode", "ttft"):
            evict(path, args.drop_caches)
            srv = start(engine, path, args.threads, server_bin, state)
            out["load_cold_s"] = srv.load_s
            srv.stop()
        warm(path)
        srv = start(engine, path, args.threads, server_bin, state)
        out["load_warm_s"] = srv.load_s
        if args.only == "load":
            srv.stop()
            return out
        try:
            if args.only == "itl":
                print(f"  {engine}: inter-token latency during a {args.itl_prompt}-token prompt")
                out["itl"] = itl_during_prefill(srv.url, 3000, args.itl_prompt, itl_trace)
                return out
            if args.only == "decode":
                settle(srv)
                for s in args.streams:
                    print(f"  {engine}: {s} concurrent streams ...", flush=True)
                    out[f"agg_{s}"] = aggregate(srv.url, 2000 + 100 * s, s, args.decode_tokens)
                return out
            out["greedy"] = greedy(srv.url)
            prompts = args.prompts if first else [p for p in args.prompts if p < max(args.prompts)]
            for i, n in enumerate(prompts):
                print(f"  {engine}: {n}-token prompt ...", flush=True)
                out[f"ttft_{n}"], out[f"prompt_tokens_{n}"] = ttft(srv.url, 1000 + 17 * i, n)
            if args.only == "ttft":
                return out
            for s in args.streams:
                print(f"  {engine}: {s} concurrent streams ...", flush=True)
                out[f"agg_{s}"] = aggregate(srv.url, 2000 + 100 * s, s, args.decode_tokens)
            if args.itl_prompt:
                print(
                    f"  {engine}: inter-token latency during a {args.itl_prompt}-token prompt ..."
                )
                out["itl"] = itl_during_prefill(srv.url, 3000, args.itl_prompt, itl_trace)
        finally:
            srv.stop()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return out


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else None


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    ft = next(rows for e, rows in results.items() if e.startswith("freetoken"))
    ll = results.get("llama.cpp", [])
    cpu = platform.processor() or "?"
    try:
        cpu = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    print(f"\nCPU: {cpu}, {args.threads} threads; medians of {args.rounds} round(s)")
    print(f"{'figure':34} {'freetoken':>12} {'llama.cpp':>12} {'ratio':>8}")

    def line(name: str, a: float | None, b: float | None, better_low: bool) -> None:
        if a is None:
            return
        if b is None:  # --no-llama: ours alone
            print(f"{name:34} {a:12.3f} {'-':>12} {'-':>8}")
            return
        ratio = b / a if better_low else a / b
        print(f"{name:34} {a:12.3f} {b:12.3f} {ratio:7.2f}x")

    line("load, cold (s)", _median(ft, "load_cold_s"), _median(ll, "load_cold_s"), True)
    line("load, warm (s)", _median(ft, "load_warm_s"), _median(ll, "load_warm_s"), True)
    if args.only == "load":
        for engine, rows in results.items():
            cold = ", ".join(f"{r['load_cold_s']:.2f}" for r in rows)
            warm_s = ", ".join(f"{r['load_warm_s']:.2f}" for r in rows)
            print(f"{engine}: cold {cold}; warm {warm_s} (s, by round)")
        return
    for n in args.prompts:
        line(
            f"time to first token, {n} tok (s)",
            _median(ft, f"ttft_{n}"),
            _median(ll, f"ttft_{n}"),
            True,
        )
    for s in args.streams:
        line(
            f"aggregate decode, {s} streams (tok/s)",
            _median(ft, f"agg_{s}"),
            _median(ll, f"agg_{s}"),
            False,
        )
    for engine, rows in results.items():
        itl = [r["itl"] for r in rows if "itl" in r]
        if itl:
            m = {k: statistics.median(i[k] for i in itl) for k in itl[0]}
            print(
                f"{engine}: ITL alone p50 {m['alone_p50_ms']:.1f} ms before, "
                f"{m['alone_after_p50_ms']:.1f} ms after (at the context it grew to); during a "
                f"{args.itl_prompt}-token prompt p50 {m['during_p50_ms']:.1f} ms, p99 "
                f"{m['during_p99_ms']:.1f} ms ({m['during_p99_ms'] / m['alone_p50_ms']:.1f}x / "
                f"{m['during_p99_ms'] / m['alone_after_p50_ms']:.1f}x the median alone before / "
                f"after, {m['during_p99_ms'] / m['during_p50_ms']:.1f}x the median during), max "
                f"{m['during_max_ms']:.1f} ms over {m['during_tokens']:.0f} tokens; that prompt's "
                f"first token after {m['long_ttft_s']:.1f} s"
            )
    if args.only in ("itl", "decode"):
        return
    for n in args.prompts:
        counts = {
            e: {r.get(f"prompt_tokens_{n}") for r in rows} - {None} for e, rows in results.items()
        }
        print(f"prompt tokens as each engine counted the {n}-token prompt: {counts}")
    if not ll:
        return
    a, b = ft[0].get("greedy", []), ll[0].get("greedy", [])
    shared = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    print(
        f"greedy: the first {shared} of 16 tokens equal ({args.weights} in both; flat random logits)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prompts", default="2048,8192,32768", help="prompt lengths for TTFT")
    ap.add_argument("--streams", default="1,2,4,8", help="concurrent stream counts")
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--itl-prompt", type=int, default=16384, help="0: skip the ITL figure")
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary (default: build one)")
    ap.add_argument("--drop-caches", action="store_true", help="cold loads drop the page cache")
    ap.add_argument("--quick", action="store_true", help="small sizes: checks the bench runs")
    ap.add_argument(
        "--only",
        choices=("load", "itl", "decode", "ttft"),
        help="load: only the cold and warm loads, each round; itl: only the ITL figure; "
        "decode: only the aggregate decode figures; ttft: only the time to first token figures",
    )
    ap.add_argument(
        "--ft-budgets",
        default="",
        help="freetokend once per --mixed-step-budget value (e.g. 2,0); default: its default",
    )
    ap.add_argument("--no-llama", action="store_true", help="freetokend only")
    ap.add_argument(
        "--itl-trace",
        type=Path,
        help="a folder: each ITL run writes the decoding stream's gaps during the long prompt "
        "there (ENGINE-TIME.json: [seconds after the prompt was sent, gap ms] per token)",
    )
    ap.add_argument(
        "--weights",
        choices=("q4_k_m", "bf16"),
        default="q4_k_m",
        help="the file both engines load: the Q4_K_M file or the converter's BF16 output",
    )
    ap.add_argument("--cache", type=Path, default=CACHE)
    args = ap.parse_args()
    args.prompts = [int(x) for x in args.prompts.split(",")]
    args.streams = [int(x) for x in args.streams.split(",")]
    if args.quick:
        args.prompts, args.streams, args.decode_tokens, args.itl_prompt = (
            [256, 512],
            [1, 2],
            8,
            1024,
        )
    args.cache.mkdir(parents=True, exist_ok=True)
    path = build_file(args.cache, args.weights)
    server_bin = args.llama_server or (
        Path("-") if args.no_llama else build_llama_server(args.cache, args.threads)
    )
    print(f"file: {path} ({path.stat().st_size / 1e9:.2f} GB); llama-server: {server_bin}")
    compile_daemon()
    engines = [f"freetoken@{b}" for b in args.ft_budgets.split(",") if b] or ["freetoken"]
    engines += [] if args.no_llama else ["llama.cpp"]
    results: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for engine in order:
            print(f"round {r + 1}: {engine} ...", flush=True)
            results[engine].append(session(engine, path, args, server_bin, first=r == 0))
    report(results, args)


if __name__ == "__main__":
    main()
