"""Load benchmark: HF safetensors vs FTW on a >= 2 GB checkpoint with Qwen3-30B-A3B expert geometry.

    PYTHONPATH=/tmp/ftpath .venv/bin/python tests/bench/bench_load.py [--layers N] [--keep-ftw]

Builds once (cached under /tmp/ftbench) a random bf16 Qwen3MoeForCausalLM checkpoint: hidden
2048, 128 experts (top-8) of moe_intermediate 768, 32 q / 4 kv heads of dim 128, a small vocab,
per-expert HF tensor names, written shard by shard straight into safetensors files (never the
whole model in memory). Converts it to FTW in a child process, then loads each format in fresh
child processes, with the page cache dropped for the checkpoint's files (cold) and not (warm),
and prints wall time, peak RSS (the child's ru_maxrss) and peak RSS / checkpoint size.
The FTW copy is deleted at the end unless --keep-ftw.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CACHE = Path("/tmp/ftbench")
GEOMETRY: dict[str, Any] = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    intermediate_size=6144,
    vocab_size=8192,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    eos_token_id=1,
)


# ---- building the checkpoint ------------------------------------------------------------------


def _layer_shapes(layer: int) -> list[tuple[str, tuple[int, ...]]]:
    g = GEOMETRY
    h, hd, e, i = g["hidden_size"], g["head_dim"], g["num_experts"], g["moe_intermediate_size"]
    p = f"model.layers.{layer}."
    out = [
        (p + "input_layernorm.weight", (h,)),
        (p + "post_attention_layernorm.weight", (h,)),
        (p + "self_attn.q_proj.weight", (g["num_attention_heads"] * hd, h)),
        (p + "self_attn.k_proj.weight", (g["num_key_value_heads"] * hd, h)),
        (p + "self_attn.v_proj.weight", (g["num_key_value_heads"] * hd, h)),
        (p + "self_attn.o_proj.weight", (h, g["num_attention_heads"] * hd)),
        (p + "self_attn.q_norm.weight", (hd,)),
        (p + "self_attn.k_norm.weight", (hd,)),
        (p + "mlp.gate.weight", (e, h)),
    ]
    for x in range(e):
        q = f"{p}mlp.experts.{x}."
        out += [
            (q + "gate_proj.weight", (i, h)),
            (q + "up_proj.weight", (i, h)),
            (q + "down_proj.weight", (h, i)),
        ]
    return out


def _shards(layers: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    h, v = GEOMETRY["hidden_size"], GEOMETRY["vocab_size"]
    shards = [_layer_shapes(n) for n in range(layers)]
    shards[0] = [("model.embed_tokens.weight", (v, h)), *shards[0]]
    shards[-1] = [*shards[-1], ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return shards


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int) -> int:
    """Streams random bf16 tensors into one safetensors file; returns the data bytes."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        n = 2 * torch.Size(shape).numel()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator().manual_seed(seed)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in tensors:
            if name.endswith("norm.weight"):
                t = 1.0 + 0.05 * torch.randn(shape, generator=gen)
            else:
                t = 0.02 * torch.randn(shape, generator=gen)
            f.write(t.to(torch.bfloat16).view(torch.uint8).numpy().data)
    return offset


def build_checkpoint(layers: int) -> Path:
    """The cached HF folder (built on first use; ``.complete`` marks a finished build)."""
    d = CACHE / f"qwen3moe-a3b-geometry-{layers}L"
    if (d / ".complete").exists():
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    shards = _shards(layers)
    weight_map: dict[str, str] = {}
    total = 0
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        print(f"  writing {name}", file=sys.stderr, flush=True)
        total += _write_safetensors(d / name, tensors, seed=k)
        weight_map.update((t, name) for t, _ in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps({**GEOMETRY, "num_hidden_layers": layers}, indent=1))
    (d / ".complete").write_text("")
    return d


def layers_for(min_bytes: int) -> int:
    per_layer = sum(2 * _numel(s) for _, s in _layer_shapes(0))
    return max(1, -(-min_bytes // per_layer))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- child processes --------------------------------------------------------------------------


def child(kind: str, folder: str, out: str | None) -> None:
    """Runs in a fresh process: one load (or the conversion, or the build); prints a JSON line."""
    if kind == "build":
        print(json.dumps({"folder": str(build_checkpoint(int(folder)))}))
        return
    import torch  # noqa: F401  (imports are part of the baseline, not of the load)

    from freetokend.models.ftw_convert import convert
    from freetokend.models.ftw_loader import load_ftw
    from freetokend.models.loader import load_model

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    nbytes = 0
    if kind == "convert":
        assert out is not None
        convert(folder, out)
    else:
        if kind == "hf":
            model, banks = load_model(folder)
        else:
            model, banks = load_ftw(folder, direct=(kind == "ftw"))
        ts = [p for p in model.parameters()] + list(banks.all_tensors().values())
        nbytes = sum(t.numel() * t.element_size() for t in ts)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"wall": wall, "peak": peak, "base": base, "nbytes": nbytes}))


def _spawn(*argv: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", *argv]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    if proc.returncode:
        raise SystemExit(f"child {argv} failed (exit {proc.returncode})")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _evict(folder: Path) -> None:
    """Drops the folder's files from the page cache. Plain os calls: the parent never imports
    torch, since Linux carries a parent's peak RSS into a child spawned by vfork + exec."""
    for p in folder.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--min-gb", type=float, default=2.0, help="checkpoint size to reach (GB)")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--keep-ftw", action="store_true")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2] if len(args.child) > 2 else None)
        return 0
    layers = args.layers or layers_for(int(args.min_gb * 1e9))
    print(f"checkpoint: {layers} layers of Qwen3-30B-A3B geometry (cache {CACHE})", flush=True)
    hf = Path(_spawn("build", str(layers))["folder"])  # torch stays out of this process
    ftw = CACHE / f"ftw-{os.getpid()}"
    try:
        conv = _spawn("convert", str(hf), str(ftw))
        print(
            f"converted to FTW in {conv['wall']:.1f} s (peak RSS {conv['peak'] / 2**30:.2f} GiB)",
            flush=True,
        )
        rows = []
        for kind, folder in (("hf", hf), ("ftw", ftw), ("ftw-buffered", ftw)):
            for cache in ("cold", "warm"):
                if cache == "cold":
                    _evict(folder)
                r = _spawn(kind, str(folder))
                rows.append((kind, cache, r))
                print(f"  {kind:<13} {cache}: {r['wall']:.2f} s", flush=True)
        _table(rows, hf, ftw)
    finally:
        if not args.keep_ftw:
            shutil.rmtree(ftw, ignore_errors=True)
    return 0


def _table(rows: list[tuple[str, str, dict[str, Any]]], hf: Path, ftw: Path) -> None:
    size = rows[0][2]["nbytes"]
    print(
        f"\nweights {size / 1e9:.2f} GB; HF folder {_dir_bytes(hf) / 1e9:.2f} GB, FTW folder {_dir_bytes(ftw) / 1e9:.2f} GB"
    )
    head = f"{'format':<13} {'cache':<5} {'wall s':>7} {'GB/s':>6} {'peak RSS GiB':>12} {'import GiB':>10} {'peak/ckpt':>9} {'(peak-import)/ckpt':>18}"
    print(head)
    print("-" * len(head))
    for kind, cache, r in rows:
        print(
            f"{kind:<13} {cache:<5} {r['wall']:>7.2f} {size / r['wall'] / 1e9:>6.2f} {r['peak'] / 2**30:>12.2f} "
            f"{r['base'] / 2**30:>10.2f} {r['peak'] / size:>9.3f} {(r['peak'] - r['base']) / size:>18.3f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
