"""Every Triton kernel compiled for real GPU targets at production shapes, on a CPU machine.

The launchers run on ``meta`` tensors of production geometry with the kernels swapped for
recorders, so what is compiled is exactly what the launchers would launch there (signature,
integer specialisation, constexprs, num_warps) and the grid they would use. Each launch is then
compiled by ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` in its own
process (tests/kernel_compile_worker.py) for sm_75, sm_86, sm_89 and sm_90, each target within
TARGET_CPU_SECONDS and all of them within TEST_CPU_SECONDS (a compile that slows down fails, it
does not stall CI; the defect this guards against took over 400 s for one target), and must:
compile;
not spill (no stack frame, no local memory, read from the cubin by
``cuobjdump -res-usage``); fit the target's shared memory and register file; launch a grid
within CUDA's limits. The compiled cubins are cached in pytest's cache folder (TRITON_CACHE_DIR),
so a second run only re-reads them.

Production shapes: Qwen3-30B-A3B (48 MoE layers, top-8 of 128 experts, H 2048, I 768),
decode batches of 1..64 tokens, prefill chunks of 8192 tokens (65,536 routes); slot caches of
2,000 slots (a 24 GiB card: the widest single sort, 2,048) and of the whole expert pool (6,144
slots, an H200: sorted in chunks of 2,048, see kernels/slot_cache.py); gpt-oss-20b for the biased GPT-OSS
activation; Mixtral-8x22B (H 6144, I 16384) for the longest bank rows (a gate_up row is
100,663,296 words) and the widest GEMV grids; paged decode attention at Qwen3-30B-A3B (32 q / 4 KV
heads, d 128) and gpt-oss-20b (64 / 8, d 64, sinks, window 128 and full) geometry, 1..64
sequences, contexts of 1 to 32k keys in 16-token bf16 pages; the Gated DeltaNet decode step at
Qwen3-Next-80B-A3B (16 key / 32 value heads, dk = dv = 128) and Qwen3.5-397B-A17B (16 / 64)
geometry, 1 and 64 sequences, fp32 and bf16 beta (the model's dtype), and its chunked prefill at
the same geometry over prefill chunks of 8192 tokens. Registers per kernel and target are printed
(``-s``) and attached to the test report as the property ``kernel_registers``. The slot-cache
kernel's step and visit counters are checked in its compiled IR: stored behind a block barrier.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
nvidia = pytest.importorskip("triton.backends.nvidia.compiler")

from triton._C.libtriton import native_specialize_impl  # noqa: E402

import ftkernels.deltanet as deltanet_mod  # noqa: E402
import ftkernels.moe_decode as moe_decode_mod  # noqa: E402
import ftkernels.paged_attention as paged_attention_mod  # noqa: E402
import ftkernels.slot_cache as slot_cache_mod  # noqa: E402

WORKER = Path(__file__).with_name("kernel_compile_worker.py")
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
TARGETS = (75, 86, 89, 90)
# opt-in shared memory per block (bytes) and the register file of one SM
SHARED_LIMIT = {75: 64 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
REGS_PER_SM = 65536
GRID_LIMITS = (2**31 - 1, 65535, 65535)
# Time limits, in CPU seconds of the compiling processes (the worker and its ptxas), so that a
# loaded machine does not fail the test and a slow-compile regression fails fast everywhere.
# Measured (cold cache, Triton 3.9): the slowest kernel and target, the slot-cache kernel with
# the sort in chunks, 10 CPU s; every compile of the test 158 CPU s (the workers' imports
# included; ~80 s on 2 free cores, 356 s on a machine loaded 5x). An unchunked 8192-wide sort
# took 43-145 s per target and spilled; the 1024-route kernel this test was first run against,
# over 400 s. A worker that burns no CPU (stuck) is cut by the wall-clock limit.
TARGET_CPU_SECONDS = 30  # per kernel and target
# every compile of the test: 240 was exceeded on a slower 2-core VM (cold cache, 2026-12-02),
# where CI runs too; the per-target limit above still catches a pathological compile
TEST_CPU_SECONDS = 480
WALL_SECONDS = 600  # the whole test, whatever the load

# (num MoE layers, experts, top-k, hidden, moe intermediate)
QWEN3_30B = (48, 128, 8, 2048, 768)
GPT_OSS_20B = (24, 32, 4, 2880, 2880)
MIXTRAL_8X22B = (56, 8, 2, 6144, 16384)
DECODE_TOKENS = (1, 64)
PREFILL_TOKENS = 8192
# Slot caches: the sort's width (BLOCK_S) and whether it is chunked (a cache wider than 2048
# slots) are the only slot-cache shapes the compile depends on. 2000 slots (~18 GiB of
# Qwen3-30B-A3B experts, a 24 GiB card) and 6144 (every expert: an H200) in every run; with
# --runslow also 600 (an 8 GiB card) and 4096 (a 48 GiB card; the same kernel as 6144).
SLOTS = (2000, 6144)
SLOTS_SLOW = (600, 2000, 4096, 6144)


@dataclass
class Launch:
    """One kernel launch as a launcher issued it (meta tensors)."""

    kernel: str
    module: str
    fn: str
    grid: tuple[int, ...]
    signature: dict[str, str]
    constexprs: dict[str, Any]
    attrs: list[tuple[int, list[Any]]]
    options: dict[str, Any]
    shapes: list[str] = field(default_factory=list)

    def key(self) -> str:
        return json.dumps(
            [self.module, self.fn, self.signature, self.constexprs, self.attrs, self.options]
        )


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kw)`` records the launch."""

    def __init__(self, jit: Any, module: str, out: list[Launch], shape: list[str]) -> None:
        self.jit, self.module, self.out, self.shape = jit, module, out, shape

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.out.append(self._spec(tuple(int(g) for g in grid), args, kwargs))

        return launch

    def _spec(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> Launch:
        params = self.jit.params
        values = dict(zip([p.name for p in params], args, strict=False))
        values.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
        options = {k: v for k, v in kwargs.items() if k not in values}
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        attrs: list[tuple[int, list[Any]]] = []
        for i, p in enumerate(params):
            v = values[p.name]
            if p.is_constexpr:
                signature[p.name], constexprs[p.name] = "constexpr", v
                continue
            ty, attr = native_specialize_impl(
                nvidia.CUDABackend, v, False, not p.do_not_specialize, True
            )
            signature[p.name] = ty
            if ty == "constexpr":
                constexprs[p.name] = v
            elif isinstance(attr, str) and attr:
                attrs.append((i, nvidia.CUDABackend.parse_attr(attr)))
        return Launch(
            self.jit.fn.__name__, self.module, self.jit.fn.__name__, grid,
            signature, constexprs, attrs, options, [self.shape[0]],
        )  # fmt: skip


def _meta(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _slot_cache_launches(shape: list[str], slot_counts: tuple[int, ...]) -> None:
    from freetokend.experts import slot_cache as sc

    layers, experts, top_k, _, _ = QWEN3_30B
    for slots in slot_counts:
        for policy in sc.EvictionPolicy:
            for tokens in (*DECODE_TOKENS, PREFILL_TOKENS):
                shape[0] = f"{slots} slots, {tokens}x{top_k} routes, {policy.name}"
                st = sc.SlotState.empty(layers, experts, slots, device="meta")
                ids = _meta(tokens, top_k)
                # the launcher itself, with the arguments decode_step's custom op passes (the op
                # on meta tensors would take its fake implementation and launch nothing)
                slot_cache_mod.decode_step_triton(
                    st, ids, layers - 1, experts, int(policy),
                    idx_bits=sc.idx_bits(slots), prio_max=sc.prio_max(slots),
                    freq_cap=sc.FREQ_CAP, freq_shift=sc.FREQ_SHIFT, key_max=sc.KEY_MAX,
                )  # fmt: skip


def _moe_decode_launches(shape: list[str]) -> None:
    for geom, gptoss in ((QWEN3_30B, False), (GPT_OSS_20B, True), (MIXTRAL_8X22B, False)):
        _, _, k, h, i = geom
        slots = 64
        for tokens in DECODE_TOKENS:
            shape[0] = f"H {h}, I {i}, {tokens}x{k} routes{', bias' if gptoss else ''}"
            bias = (
                _meta(slots, 2 * i, dtype=torch.bfloat16),
                _meta(slots, h, dtype=torch.bfloat16),
            )
            moe_decode_mod.moe_decode(
                _meta(tokens, h, dtype=torch.bfloat16), _meta(tokens, k), _meta(tokens, k,
                dtype=torch.float32), _meta(slots, 2 * i, h, dtype=torch.bfloat16),
                _meta(slots, h, i, dtype=torch.bfloat16), *(bias if gptoss else (None, None)),
                int(gptoss), 1.702, 7.0,
            )  # fmt: skip
    # the other activations are constexpr specialisations of their own: gelu_tanh (Gemma-4)
    # and DeepSeek-V4's clamped SwiGLU, at Qwen3-30B-A3B's geometry
    _, _, k, h, i = QWEN3_30B
    for act in (2, 3):
        shape[0] = f"H {h}, I {i}, 1x{k} routes, activation {act}"
        moe_decode_mod.moe_decode(
            _meta(1, h, dtype=torch.bfloat16), _meta(1, k), _meta(1, k, dtype=torch.float32),
            _meta(64, 2 * i, h, dtype=torch.bfloat16), _meta(64, h, i, dtype=torch.bfloat16),
            None, None, act, 1.702, 7.0,
        )  # fmt: skip


def _copy_launches(shape: list[str]) -> None:
    for geom in (QWEN3_30B, MIXTRAL_8X22B):
        _, _, k, h, i = geom
        for rows in ((2 * i, h), (h, i)):
            for copies in (DECODE_TOKENS[-1] * k, PREFILL_TOKENS * k):
                shape[0] = f"row {rows} bf16, {copies} copies"
                dst, src = (
                    _meta(16, *rows, dtype=torch.bfloat16),
                    _meta(4, *rows, dtype=torch.bfloat16),
                )
                moe_decode_mod.copy_rows(dst, src, _meta(copies), _meta(copies), _meta(1))


# paged decode attention: (q heads, kv heads, head dim, sinks, window) of Qwen3-30B-A3B and of
# gpt-oss-20b's sliding layers (its full layers: the same without the window); contexts to 32k
ATTENTION = ((32, 4, 128, False, None), (64, 8, 64, True, 128), (64, 8, 64, True, None))
ATTENTION_BATCHES = (1, 8, 64)
ATTENTION_CONTEXTS = (1, 4096, 32768)
KV_PAGE = 16


def _attention_launches(shape: list[str]) -> None:
    for heads, kvh, d, sinks, window in ATTENTION:
        for batch in ATTENTION_BATCHES:
            for ctx in ATTENTION_CONTEXTS:
                shape[0] = f"{heads}/{kvh} heads, d {d}, {batch} seqs x {ctx} keys, w {window}"
                pages = batch * -(-ctx // KV_PAGE)
                kp = _meta(pages, KV_PAGE, kvh, d, dtype=torch.bfloat16)
                paged_attention_mod.paged_decode_attention(
                    _meta(batch, heads, d, dtype=torch.bfloat16), kp, kp,
                    _meta(batch, -(-ctx // KV_PAGE)), _meta(batch), _meta(batch), ctx, d**-0.5,
                    window, _meta(heads, dtype=torch.bfloat16) if sinks else None,
                )  # fmt: skip


# Gated DeltaNet decode: (key heads, value heads, dk, dv) of Qwen3-Next-80B-A3B, Qwen3.5-397B-A17B
DELTANET = ((16, 32, 128, 128), (16, 64, 128, 128))
DELTANET_LAYERS = 48  # linear-attention layers of a state: the layer offset's range


def _deltanet_launches(shape: list[str]) -> None:
    for kh, heads, dk, dv in DELTANET:
        for batch in ATTENTION_BATCHES[::2]:
            for beta in (torch.float32, torch.bfloat16):
                shape[0] = f"{kh}/{heads} heads, dk {dk}, dv {dv}, {batch} seqs, beta {beta}"
                qk = _meta(batch, kh, dk, dtype=torch.float32)
                states = [_meta(DELTANET_LAYERS, heads, dk, dv, dtype=torch.float32)] * batch
                deltanet_mod.deltanet_decode(
                    qk, qk, _meta(batch, heads, dv, dtype=torch.float32),
                    _meta(batch, heads, dtype=torch.float32), _meta(batch, heads, dtype=beta),
                    states, _meta(batch, dtype=torch.int64), DELTANET_LAYERS - 1,
                )  # fmt: skip
        for beta in (torch.float32, torch.bfloat16):
            shape[0] = (
                f"{kh}/{heads} heads, dk {dk}, dv {dv}, prefill {PREFILL_TOKENS}, beta {beta}"
            )
            qk = _meta(PREFILL_TOKENS, kh, dk, dtype=torch.float32)
            gb = _meta(PREFILL_TOKENS, heads, dtype=torch.float32)
            deltanet_mod.deltanet_prefill(
                qk, qk, _meta(PREFILL_TOKENS, heads, dv, dtype=torch.float32), gb,
                gb.to(beta), _meta(heads, dk, dv, dtype=torch.float32),
            )  # fmt: skip


def record_launches(
    monkeypatch: pytest.MonkeyPatch, slot_counts: tuple[int, ...] = SLOTS
) -> list[Launch]:
    """Every launch of every kernel at the production shapes, in launch order."""
    out: list[Launch] = []
    shape = [""]
    for mod in (slot_cache_mod, moe_decode_mod, paged_attention_mod, deltanet_mod):
        for name, value in list(vars(mod).items()):
            if isinstance(value, triton.runtime.JITFunction) and name in LAUNCHED:
                monkeypatch.setattr(mod, name, _Recorder(value, mod.__name__, out, shape))
    _slot_cache_launches(shape, slot_counts)
    _moe_decode_launches(shape)
    _copy_launches(shape)
    _attention_launches(shape)
    _deltanet_launches(shape)
    return out


# kernels launched from Python; the other @triton.jit functions are their device helpers
LAUNCHED = {"_decode_kernel", "_copy_rows_kernel", "_gate_up_kernel", "_down_kernel",
            "_split_kernel", "_reduce_kernel", "_recurrent_step_kernel", "_prefill_kernel"}  # fmt: skip


def test_every_triton_kernel_is_covered() -> None:
    """A new @triton.jit anywhere in the code must be launched here or called by one that is."""
    root = Path(__file__).resolve().parents[1]
    files = [p for d in ("kernels", "daemon", "ctl") for p in (root / d).rglob("*.py")]
    decorator = re.compile(r"^\s*@(triton\.)?jit\b", re.M)
    jit_files = {p.name for p in files if decorator.search(p.read_text(encoding="utf-8"))}
    assert jit_files == {"slot_cache.py", "moe_decode.py", "paged_attention.py", "deltanet.py"}, (
        jit_files
    )
    for mod in (slot_cache_mod, moe_decode_mod, paged_attention_mod, deltanet_mod):
        jits = {n: v for n, v in vars(mod).items() if isinstance(v, triton.runtime.JITFunction)}
        for name in jits.keys() - LAUNCHED:
            callers = [n for n, f in jits.items() if n != name and f"{name}(" in f.src]
            assert callers, f"{mod.__name__}.{name} is neither launched nor called by a kernel"


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _group_cpu(pgid: int) -> float:
    """CPU seconds of a process group: each live member's own and its reaped children's."""
    ticks = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2 :].split()
        if int(f[2]) == pgid:
            ticks += sum(int(v) for v in f[11:15])  # utime stime cutime cstime
    return ticks / _TICK


class _Budget:
    """The CPU seconds all compiles of the test may take, shared by the worker threads."""

    def __init__(self, cpu: float, wall: float) -> None:
        self.left, self.wall_end, self.lock = cpu, time.monotonic() + wall, threading.Lock()

    def spend(self, cpu: float) -> None:
        with self.lock:
            self.left -= cpu


def _compile(launch: Launch, cache: Path, budget: _Budget) -> list[dict[str, Any]]:
    """Rows of the worker (one per target). The worker and its ptxas are killed when a target
    takes over TARGET_CPU_SECONDS, the test's CPU budget runs out or its wall clock ends; the
    targets left get a failing row."""
    spec = {
        "module": launch.module, "fn": launch.fn, "signature": launch.signature,
        "constexprs": launch.constexprs, "attrs": launch.attrs, "options": launch.options,
        "targets": list(TARGETS),
    }  # fmt: skip
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen(
        [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    assert proc.stdin and proc.stdout and proc.stderr
    proc.stdin.write(json.dumps(spec))
    proc.stdin.close()
    rows: list[dict[str, Any]] = []
    err, spent, row_at = "", 0.0, 0.0  # CPU seconds of the group: in all, at the last row
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(rows) < len(TARGETS):
            if sel.select(0.5):
                line = proc.stdout.readline()
                if not line:  # the worker died
                    err = proc.stderr.read()[-2000:] or f"worker exited with {proc.wait()}"
                    break
                if line.startswith("{"):
                    rows.append(json.loads(line))
                    row_at = spent
                continue
            now = _group_cpu(proc.pid)
            budget.spend(now - spent)
            spent = now
            late = (
                f"{TARGET_CPU_SECONDS} CPU s" if spent - row_at > TARGET_CPU_SECONDS
                else f"the test's {TEST_CPU_SECONDS} CPU s" if budget.left < 0
                else f"the test's {WALL_SECONDS} s" if time.monotonic() > budget.wall_end
                else ""
            )  # fmt: skip
            if late:  # the target compiling now and every later one fail
                err = f"not compiled within {late} (killed)"
                os.killpg(proc.pid, signal.SIGKILL)
                break
    proc.wait()
    proc.stderr.close()
    done = {r["cc"] for r in rows}
    return rows + [{"cc": cc, "ok": False, "error": err} for cc in TARGETS if cc not in done]


def _problems(launch: Launch, row: dict[str, Any]) -> list[str]:
    cc = row["cc"]
    if not row["ok"]:
        return [f"sm_{cc}: does not compile: {row['error']}"]
    out = []
    if row["stack"] or row["local"]:
        out.append(f"sm_{cc}: spills ({row['stack']} B stack, {row['local']} B local)")
    if row["shared"] > SHARED_LIMIT[cc]:
        out.append(f"sm_{cc}: {row['shared']} B shared memory > {SHARED_LIMIT[cc]}")
    if row["regs"] * row["num_warps"] * 32 > REGS_PER_SM:
        out.append(f"sm_{cc}: {row['regs']} registers x {row['num_warps']} warps > one SM")
    return out


@pytest.mark.skipif(not CUOBJDUMP.is_file(), reason="triton without its NVIDIA tools")
def test_kernels_compile_for_real_targets(
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    slow = request.config.getoption("--runslow") or os.environ.get("FT_RUN_SLOW") == "1"
    launches = record_launches(monkeypatch, SLOTS_SLOW if slow else SLOTS)
    assert {x.kernel for x in launches} == LAUNCHED

    # grids of the largest shapes (every launch was recorded, not only the distinct ones)
    bad_grids = [
        f"{x.kernel} [{x.shapes[0]}]: grid {x.grid}"
        for x in launches
        if any(g > lim for g, lim in zip(x.grid, GRID_LIMITS, strict=False)) or len(x.grid) > 3
    ]

    distinct: dict[str, Launch] = {}
    for x in launches:  # shapes that compile to the same kernel share one compile
        first = distinct.setdefault(x.key(), x)
        if first is not x:
            first.shapes.extend(x.shapes)
    store = getattr(request.config, "cache", None)  # absent with -p no:cacheprovider
    cache = Path(store.mkdir("ft_triton_targets")) if store else tmp_path_factory.mktemp("triton")
    started = time.monotonic()
    budget = _Budget(TEST_CPU_SECONDS, WALL_SECONDS)
    workers = max(1, min(2, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda x: (x, _compile(x, cache, budget)), distinct.values()))

    problems, table = list(bad_grids), []
    for launch, rows in results:
        keep = {"POLICY": "policy", "BLOCK_S": "sort", "CHUNKED": "chunked", "HAS_BIAS": "bias",
                "D": "d", "G": "group", "HAS_WINDOW": "window", "HAS_SINKS": "sinks",
                "H": "heads", "HK": "kheads", "DK": "dk", "BV": "bv", "C": "chunk"}  # fmt: skip
        cx = " ".join(f"{keep[k]}={int(v)}" for k, v in launch.constexprs.items() if k in keep)
        if "beta_ptr" in launch.signature:  # the DeltaNet step compiles per beta dtype
            cx += f" beta={launch.signature['beta_ptr'].lstrip('*')}"
        label = f"{launch.kernel} {cx}".strip()
        problems += [f"{label}: {p}" for r in rows for p in _problems(launch, r)]
        cells = {
            r["cc"]: (
                f"{r['regs']}/{r['stack'] + r['local']}/{r['shared'] >> 10}/{r['cpu_seconds']:.0f}"
                if r["ok"]
                else "FAIL"
            )
            for r in rows
        }
        table.append(f"{label:<62} " + " ".join(f"{cells[cc]:>14}" for cc in TARGETS))
    header = f"{'kernel':<62} " + " ".join(f"{'sm_' + str(cc):>14}" for cc in TARGETS)
    legend = (
        "cells: registers per thread / spilled bytes per thread (stack + local) / shared KiB "
        "per block / compile CPU seconds"
    )
    cpu = TEST_CPU_SECONDS - budget.left
    elapsed = f"({cpu:.0f} CPU s, {time.monotonic() - started:.0f} s)"
    report = "\n".join([legend, header, *table, elapsed])
    print("\n" + report)
    request.node.user_properties.append(("kernel_registers", report))
    assert not problems, "\n".join(problems)


def _ttir(launch: Launch, cc: int, cache: Path) -> list[str]:
    """Lines of the Triton IR of ``launch`` compiled for sm_``cc``, by the worker in a process
    of its own: in this one, an interpreted twin of the kernel module (kernels/interp.py) may
    have left triton's library functions in interpreter mode by then."""
    spec = {
        "module": launch.module, "fn": launch.fn, "signature": launch.signature,
        "constexprs": launch.constexprs, "attrs": launch.attrs, "options": launch.options,
        "targets": [cc], "ttir": True,
    }  # fmt: skip
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run(
        [sys.executable, str(WORKER)], input=json.dumps(spec), capture_output=True, text=True,
        env=env, timeout=300,
    )  # fmt: skip
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert rows and rows[0]["ok"], (rows, run.stderr[-2000:])
    return str(rows[0]["ttir"]).splitlines()


def _lines(lines: list[str], pattern: str) -> list[int]:
    return [i for i, line in enumerate(lines) if re.search(pattern, line)]


@pytest.mark.skipif(not CUOBJDUMP.is_file(), reason="triton without its NVIDIA tools")
def test_slot_kernel_stores_step_and_visits_after_every_warp_read_them(
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Every thread of the decode kernel loads the step counter and the layer's visit count;
    one thread stores them back incremented. Without a block barrier in between, a warp that
    loads after that store runs the step with one more (its hits' last_used, its keys'
    blocking). Only a GPU shows the race; here the order, in the kernel as compiled."""
    launches = record_launches(monkeypatch, SLOTS[:1])
    launch = next(x for x in launches if x.kernel == "_decode_kernel")
    store = getattr(request.config, "cache", None)  # the cache the compile test fills
    cache = Path(store.mkdir("ft_triton_targets")) if store else tmp_path_factory.mktemp("triton")
    lines = _ttir(launch, 90, cache)
    visit = re.search(r"(%\S+) = tt\.addptr %visits_ptr, %layer\b", "\n".join(lines))
    assert visit is not None
    barriers = _lines(lines, r"\b(ttg|gpu)\.barrier\b")
    for ptr in ("%step_ptr", visit.group(1)):
        loads, stores = _lines(lines, rf"tt\.load {ptr}\b"), _lines(lines, rf"tt\.store {ptr}\b")
        assert loads and stores, ptr
        assert any(max(loads) < b < min(stores) for b in barriers), f"no barrier before {ptr}"


def test_a_slow_compile_is_killed_at_its_cpu_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The guard itself: a compile over its CPU limit fails every target left, fast, and leaves
    no process of the worker's group (ptxas included) behind (a fresh cache: nothing to re-read)."""
    launch = next(x for x in record_launches(monkeypatch, (6144,)) if x.kernel == "_decode_kernel")
    monkeypatch.setattr(sys.modules[__name__], "TARGET_CPU_SECONDS", 1)
    procs: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def spawn(*a: Any, **kw: Any) -> subprocess.Popen:
        procs.append(popen(*a, **kw))
        return procs[-1]

    monkeypatch.setattr(subprocess, "Popen", spawn)
    started = time.monotonic()
    rows = _compile(launch, tmp_path, _Budget(60, 60))
    assert [r["ok"] for r in rows] == [False] * len(TARGETS)
    assert all("within 1 CPU s (killed)" in r["error"] for r in rows)
    assert time.monotonic() - started < 45
    (worker,) = procs
    assert worker.returncode == -signal.SIGKILL
    assert _group_cpu(worker.pid) == 0  # no member left
