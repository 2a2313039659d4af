"""GGUF load benchmark: load time and peak RSS over file size for a >= 2 GB GGUF file with
Qwen3-30B-A3B expert geometry (random weights).

    .venv/bin/python tests/bench/bench_gguf_load.py [--type bf16|f32|q8_0|q4_k_m] [--min-gb 2.0]
        [--generate N]

Writes once (cached under /tmp/ftbench-gguf) a ``qwen3moe`` GGUF: hidden 2048, 128 experts
(top-8) of 768, 32 q / 4 kv heads of dim 128, vocab 8192, tensors written one at a time (never
the whole model in memory). Then loads it in a fresh child process (page cache warm) and prints
wall time and the child's peak RSS, raw and over its baseline (its RSS after importing torch and
the loaders, before loading: the figure the weights themselves cost), each also over the file
size (target <= 1.15: memory-mapped, never two copies). BF16/F32 files are read into their final
tensors; a Q8_0 file is not dequantized either: its projections and experts stay in their Q8_0
blocks (the native integer-dot kernels), only norms and routers being F32; a Q4_K_M file (Q4_K,
with Q6_K for attn_v, ffn_down_exps and output, as llama.cpp's mix; quantized by our own
gguf_blocks, as the gguf package has no K-quant quantizer) stays in its blocks too.

--generate N: the child loads the file as the daemon does (``LLM``, the CPU backend, a 4096-token
KV pool) and decodes N tokens before its peak RSS is read: the figure while serving, the KV pool's
written pages and the decode's activations included.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CACHE = Path("/tmp/ftbench-gguf")
SIX_BIT = ("attn_v.weight", "ffn_down_exps.weight", "output.weight")  # Q6_K in the q4_k_m mix
H, E, K, I_MOE, HEADS, KV, HD, VOCAB = 2048, 128, 8, 768, 32, 4, 128, 8192


def _shapes(layers: int, vocab: int = VOCAB) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and shapes of a Qwen3-30B-A3B-geometry model of ``layers`` layers
    (bench_gguf_startup.py builds its file from these too)."""
    out = [
        ("token_embd.weight", (vocab, H)),
        ("output_norm.weight", (H,)),
        ("output.weight", (vocab, H)),
    ]
    for i in range(layers):
        b = f"blk.{i}"
        out += [
            (f"{b}.attn_norm.weight", (H,)),
            (f"{b}.ffn_norm.weight", (H,)),
            (f"{b}.attn_q.weight", (HEADS * HD, H)),
            (f"{b}.attn_k.weight", (KV * HD, H)),
            (f"{b}.attn_v.weight", (KV * HD, H)),
            (f"{b}.attn_output.weight", (H, HEADS * HD)),
            (f"{b}.attn_q_norm.weight", (HD,)),
            (f"{b}.attn_k_norm.weight", (HD,)),
            (f"{b}.ffn_gate_inp.weight", (E, H)),
            (f"{b}.ffn_gate_exps.weight", (E, I_MOE, H)),
            (f"{b}.ffn_up_exps.weight", (E, I_MOE, H)),
            (f"{b}.ffn_down_exps.weight", (E, H, I_MOE)),
        ]
    return out


def build(kind: str, min_gb: float) -> Path:
    import gguf
    from gguf import GGMLQuantizationType as Q

    qt = {"f32": Q.F32, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_k_m": Q.Q4_K}[kind]

    def type_of(name: str, shape: tuple[int, ...]) -> Q:
        if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):
            return Q.F32
        if kind == "q4_k_m" and name.endswith(SIX_BIT):
            return Q.Q6_K
        return qt

    def nbytes(name: str, shape: tuple[int, ...]) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[type_of(name, shape)]
        return int(np.prod(shape)) * type_size // block

    per_layer = sum(nbytes(n, s) for n, s in _shapes(1)[3:])
    layers = max(1, int(np.ceil(min_gb * 2**30 / per_layer)))
    path = CACHE / f"qwen3moe-{layers}L-{kind}.gguf"
    if path.exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, "qwen3moe")
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
    rng = np.random.default_rng(0)
    shapes = _shapes(layers)

    pool = rng.standard_normal(1 << 20, dtype=np.float32) * 0.02  # tiled: content is irrelevant

    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        a = np.resize(np.roll(pool, n % 4099), n).reshape(shape)
        t = type_of(name, shape)
        if t == Q.F32:
            return a
        if t in (Q.Q4_K, Q.Q6_K):  # rows of raw blocks, [..., row bytes]
            import torch

            from freetokend.formats import gguf_blocks

            fmt = "q4_k" if t == Q.Q4_K else "q6_k"
            raw = gguf_blocks.quantize(torch.from_numpy(a.reshape(-1, shape[-1])), fmt)
            return raw.numpy().reshape(*shape[:-1], -1)
        return gguf.quants.quantize(a, t)

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
    return path


def _status_bytes(key: str) -> int:
    """A figure of /proc/self/status in bytes: VmRSS (resident now) or VmHWM (its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _rss_now() -> int:
    return _status_bytes("VmRSS")


def child(path: str, generate: int) -> None:
    import gguf  # noqa: F401  (the reader and the loaders imported before the baseline)

    import freetokend.models.gguf_loader  # noqa: F401
    from freetokend import LLM
    from freetokend.models.loader import load_model

    baseline = _rss_now()
    t0 = time.perf_counter()
    if generate:
        llm = LLM(path, moe_backend="cpu", max_model_len=4096)
        model, banks = llm.model, llm.banks
    else:
        model, banks = load_model(path)
    dt = time.perf_counter() - t0
    r = {"load_s": dt, "baseline_rss": baseline}
    if generate:
        t0 = time.perf_counter()
        out = llm.generate(list(range(100, 164)), generate, ignore_eos=True)
        r["generate_s"], r["generated"] = time.perf_counter() - t0, len(out)
        r["kv_bytes"] = llm.runner.kv.nbytes
    # VmHWM, not getrusage's ru_maxrss: Linux folds the parent's resident set at fork into the
    # child's ru_maxrss at exec (a parent that just built the file holds gigabytes), while the
    # high-water mark belongs to the address space exec made
    r["peak_rss"] = _status_bytes("VmHWM")
    blocks = sum(getattr(m, "qweight", None) is not None for m in model.modules())
    print(json.dumps({**r, "expert_format": banks.format, "dense_in_blocks": blocks}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="bf16", choices=["f32", "bf16", "q8_0", "q4_k_m"])
    ap.add_argument("--min-gb", type=float, default=2.0)
    ap.add_argument("--generate", type=int, default=0, help="decode N tokens after loading")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.generate)
        return
    t0 = time.perf_counter()
    path = build(a.type, a.min_gb)
    size = path.stat().st_size
    print(f"file {path} ({size / 2**30:.2f} GiB, built/cached in {time.perf_counter() - t0:.1f} s)")
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(path), "--generate", str(a.generate)],
        capture_output=True,
        text=True,
        check=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    peak, base = r["peak_rss"], r["baseline_rss"]
    print(
        f"{a.type}: load {r['load_s']:.2f} s, peak RSS {peak / 2**30:.2f} GiB "
        f"(/ file size {peak / size:.3f}); baseline after imports {base / 2**30:.2f} GiB; "
        f"peak over baseline {(peak - base) / 2**30:.2f} GiB (/ file size {(peak - base) / size:.3f})"
    )
    print(f"experts as {r['expert_format']}, {r['dense_in_blocks']} dense projections in blocks")
    if a.generate:
        kv = r["kv_bytes"]
        print(
            f"served: {r['generated']} tokens decoded in {r['generate_s']:.2f} s before the peak; "
            f"KV pool {kv / 2**30:.2f} GiB reserved (its default size; only the pages written "
            "so far are resident, so it is part of the peak only as far as it was used)"
        )


if __name__ == "__main__":
    main()
