"""GGUF start-up benchmark: the time to load one GGUF file as the daemon does (``LLM(path)``:
config, weights, huge pages, tokenizer, anchor ids, engine), warm and cold, against llama.cpp's
load of the same file when llama-cpp-python is installed.

    PYTHONPATH=... .venv/bin/python tests/bench/bench_gguf_startup.py [--repeats 5] [--cold 3]
        [--layers 4] [--vocab 50257] [--drop-caches] [--profile OUT.prof] [--no-huge-pages]

The file (written once, cached under /tmp/ftbench-startup) has Qwen3-30B-A3B's layer geometry
(hidden 2048, 128 experts of 768, top-8, 32 q / 4 kv heads of dim 128), 4 layers by default,
in llama.cpp's Q4_K_M mix (Q4_K; Q6_K for output, and for attn_v and ffn_down_exps in the
layers llama.cpp's ``use_more_bits`` picks: per-layer expert formats), about 1.6 GB, and a
byte-level BPE tokenizer of ``--vocab`` tokens with as many merges in its metadata (a synthetic
vocabulary: every merge joins two earlier tokens, so the tokenizer is a valid BPE of GPT-2's
size; the weights are raw blocks quantized once from random values and tiled: content is
irrelevant to a load).

Each load runs in a fresh child process that first imports what the daemon imports (timed
apart: "imports"), then times ``LLM(path, moe_backend="cpu")``. Warm: the file was read just
before (in the page cache). Cold: the file's pages are evicted first: with ``--drop-caches`` (root
only) the whole page cache (``echo 3 > /proc/sys/vm/drop_caches``), else only this file's pages
(``posix_fadvise(DONTNEED)``, what ``fincore`` then confirms), which leaves other users' caches
alone on a shared machine. Figures are medians; warm and cold runs interleave.

``--profile OUT.prof``: one more warm load under cProfile, its top functions printed and the
stats written to OUT.prof.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# the same geometry as bench_gguf_load.py (this folder is on sys.path)
from bench_gguf_load import HD, HEADS, I_MOE, KV, E, H, K, _shapes

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path("/tmp/ftbench-startup")
MORE_BITS = ("attn_v.weight", "ffn_down_exps.weight")  # Q6_K in the layers llama.cpp picks
EOS = "<|endoftext|>"
ADDED = (EOS, "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")
SAMPLE = (
    "Hello world! The quick brown fox jumps over the lazy dog. Grüße aus Köln, 日本語のテキスト, "
    'def f(x):\n    return {"a": [1, 2, 3]}\n<|im_start|>user\nhi<|im_end|>'
)


# ---- building the file ------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def write_tokenizer_folder(out: Path, vocab_size: int) -> Path:
    """tokenizer.json + tokenizer_config.json of a synthetic byte-level BPE of ``vocab_size``
    tokens (the added tokens last), every merge joining two earlier tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    rng = np.random.default_rng(0)
    alphabet = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tokens = list(alphabet)
    merges: list[tuple[str, str]] = []
    letters = [c for c in alphabet if c.isalpha() and c.isascii()] + ["Ġ"]
    target = vocab_size - len(ADDED)
    while len(tokens) < target:
        # favour short pieces over letters so that real text merges often
        if len(tokens) < 2000:
            a, b = letters[rng.integers(len(letters))], letters[rng.integers(len(letters))]
        else:
            a = tokens[rng.integers(len(tokens) // 4 + 256)]
            b = tokens[rng.integers(len(tokens))]
        if a + b in vocab or len(a + b) > 16:
            continue
        vocab[a + b] = len(tokens)
        tokens.append(a + b)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED[3:]])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED[:3]])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "eos_token": "<|im_end|>",
        "pad_token": EOS,
        "bos_token": None,
        "chat_template": (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def build(layers: int, vocab: int) -> Path:
    """The benchmark's GGUF file (cached)."""
    path = CACHE / f"qwen3moe-{layers}L-v{vocab}-q4_k_m.gguf"
    if path.exists():
        return path
    import gguf
    import torch
    from gguf import GGMLQuantizationType as Q

    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_files import write_tokenizer

    from freetokend.formats import gguf_blocks

    CACHE.mkdir(parents=True, exist_ok=True)
    folder = write_tokenizer_folder(CACHE / f"tok-{vocab}", vocab)
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(tmp, "qwen3moe")
    for key, v in (
        ("block_count", layers), ("context_length", 4096), ("embedding_length", H),
        ("feed_forward_length", 6144), ("expert_feed_forward_length", I_MOE),
        ("attention.head_count", HEADS), ("attention.head_count_kv", KV),
        ("attention.key_length", HD), ("attention.value_length", HD),
        ("expert_count", E), ("expert_used_count", K),
    ):  # fmt: skip
        w.add_uint32(f"qwen3moe.{key}", v)
    w.add_float32("qwen3moe.rope.freq_base", 1e6)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    write_tokenizer(w, folder, "qwen2")
    rng = np.random.default_rng(0)
    pools: dict[tuple[Q, int], np.ndarray] = {}

    def type_of(name: str, shape: tuple[int, ...]) -> Q:
        if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):
            return Q.F32
        if name == "output.weight":
            return Q.Q6_K
        if name.endswith(MORE_BITS):  # llama.cpp's use_more_bits(i, n) of the Q4_K_M mix
            i, n = int(name.split(".")[1]), layers
            more = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
            return Q.Q6_K if more else Q.Q4_K
        return Q.Q4_K

    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        t, row = type_of(name, shape), shape[-1]
        rows = int(np.prod(shape[:-1]))
        if t == Q.F32:
            return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
        if (t, row) not in pools:  # 509 rows quantized once, tiled (a prime: rows differ)
            a = torch.from_numpy(rng.standard_normal((509, row), dtype=np.float32) * 0.02)
            pools[t, row] = gguf_blocks.quantize(a, t.name.lower()).numpy()
        pool = pools[t, row]
        reps = -(-rows // len(pool))
        return np.tile(pool, (reps, 1))[:rows].reshape(*shape[:-1], -1)

    def nbytes(name: str, shape: tuple[int, ...]) -> int:
        block, size = gguf.GGML_QUANT_SIZES[type_of(name, shape)]
        return int(np.prod(shape)) * size // block

    shapes = _shapes(layers, vocab)
    for name, shape in shapes:  # sizes first: the header precedes the data
        w.add_tensor_info(
            name, shape, np.dtype(np.float32), nbytes(name, shape), raw_dtype=type_of(name, shape)
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape in shapes:
        w.write_tensor_data(tensor(name, shape))
    w.close()
    tmp.rename(path)
    return path


# ---- the child: one load ----------------------------------------------------------------------


def child(path: str, engine: str, huge_pages: bool, profile: str | None) -> None:
    t0 = time.perf_counter()
    if engine == "llama.cpp":
        import llama_cpp

        t1 = time.perf_counter()
        llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_threads=2, verbose=False)
        t2 = time.perf_counter()
        ids = llm.tokenize(SAMPLE.encode(), add_bos=False, special=True)
        print(json.dumps({"imports_s": t1 - t0, "load_s": t2 - t1, "ids": ids[:8]}))
        return
    import torch  # noqa: F401

    from freetokend import LLM

    t1 = time.perf_counter()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    llm = LLM(path, moe_backend="cpu", max_model_len=4096, kv_tokens=4096, huge_pages=huge_pages)
    t2 = time.perf_counter()
    if prof is not None and profile:
        prof.disable()
        prof.dump_stats(profile)
    ids = llm.tokenizer.encode(SAMPLE)
    print(json.dumps({"imports_s": t1 - t0, "load_s": t2 - t1, "ids": ids[:8]}))


# ---- the parent -------------------------------------------------------------------------------


def evict(path: Path, drop_caches: bool) -> str:
    """Evicts ``path`` from the page cache; says how."""
    if drop_caches and os.geteuid() == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return "fadvise" if not drop_caches else "fadvise (not root: drop_caches refused)"


def cached_fraction(path: Path) -> float | None:
    """The fraction of ``path`` in the page cache (``fincore``), None without it."""
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return int(out[0]) / path.stat().st_size if out else None


def warm(path: Path) -> None:
    with path.open("rb") as f:
        while f.read(64 << 20):
            pass


def run_child(path: Path, engine: str, huge_pages: bool, profile: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", str(path), "--engine", engine]
    if not huge_pages:
        cmd.append("--no-huge-pages")
    if profile:
        cmd += ["--profile", profile]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{engine} load failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--repeats", type=int, default=5, help="warm loads per engine")
    ap.add_argument("--cold", type=int, default=3, help="cold loads per engine")
    ap.add_argument("--drop-caches", action="store_true", help="cold: drop the whole page cache")
    ap.add_argument("--no-huge-pages", action="store_true")
    ap.add_argument("--profile", help="one more warm load under cProfile, stats to this file")
    ap.add_argument("--child")
    ap.add_argument("--engine", default="freetoken")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.engine, not a.no_huge_pages, a.profile)
        return
    t0 = time.perf_counter()
    path = build(a.layers, a.vocab)
    size = path.stat().st_size
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        "?",
    )
    print(f"file {path} ({size / 1e9:.2f} GB, built/cached in {time.perf_counter() - t0:.1f} s)")
    print(f"cpu: {cpu}, {os.cpu_count()} cores")
    engines = ["freetoken"]
    if importlib.util.find_spec("llama_cpp") is not None:
        engines.append("llama.cpp")
    else:
        print("llama.cpp: skipped (llama_cpp, llama-cpp-python, is not importable)")
    huge = not a.no_huge_pages
    results: dict[tuple[str, str], list[dict]] = {}
    how = ""
    for r in range(max(a.repeats, a.cold)):
        for engine in engines:
            if r < a.repeats:
                warm(path)
                results.setdefault((engine, "warm"), []).append(run_child(path, engine, huge))
            if r < a.cold:
                how = evict(path, a.drop_caches)
                frac = cached_fraction(path)
                if frac is not None and frac > 0.05:
                    print(f"  (cold run: {frac:.0%} of the file still cached after {how})")
                results.setdefault((engine, "cold"), []).append(run_child(path, engine, huge))
    if how:
        print(f"cold: the file evicted by {how}")
    for (engine, kind), rs in results.items():
        loads = [x["load_s"] for x in rs]
        imports = [x["imports_s"] for x in rs]
        print(
            f"{engine:10s} {kind}: load median {statistics.median(loads):6.2f} s "
            f"(min {min(loads):.2f}, max {max(loads):.2f}, n={len(loads)}; "
            f"{size / 1e9 / statistics.median(loads):.2f} GB/s); "
            f"imports median {statistics.median(imports):.2f} s"
        )
    if a.profile:
        warm(path)
        run_child(path, "freetoken", huge, a.profile)
        import pstats

        pstats.Stats(a.profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
